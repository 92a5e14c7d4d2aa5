"""The test helpers' live server (clef_vllm/testing/server.py): ports handed out once per process."""

from __future__ import annotations


def test_free_port_never_hands_out_one_port_twice(monkeypatch):
    """Servers started together each ask for a port before any binds one: when the system offers the same
    free port twice, the second asker gets another (two servers once shared a port and a log file)."""
    import socket

    from clef_vllm.testing import server as testing_server

    offered = iter([47001, 47001, 47002])

    class Offering:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            pass

        def getsockname(self):
            return ("127.0.0.1", next(offered))

    monkeypatch.setattr(testing_server, "_HANDED_OUT", set())
    monkeypatch.setattr(socket, "socket", lambda *a, **k: Offering())
    assert [testing_server.free_port(), testing_server.free_port()] == [47001, 47002]
