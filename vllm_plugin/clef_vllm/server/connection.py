"""Connection rules on top of uvicorn's HTTP/1.1 (h11) protocol, for clients that are slow, many,
half-closed or gone:

* a connection must deliver a complete request head (request line + headers) within
  ``header_timeout`` seconds of opening, or of the first byte of a later request on a kept-alive
  connection; otherwise it is closed (with a 408 if part of a head had arrived). Idle kept-alive
  connections close after ``keep_alive_timeout`` (uvicorn's own timer);
* at most ``max_connections`` connections are open; beyond them :data:`PROBE_CONNECTIONS` more are
  kept for the probes (the app serves ``GET /health``, ``/health/live`` and ``/metrics`` on them and
  answers anything else 503; each closes after its answer), so an orchestrator never restarts a
  server that is merely busy; one more than that gets 503 and is closed;
* a client that shuts down its sending side after its request (``SHUT_WR``, "half-close") still
  gets its answer. uvicorn closes the connection at end-of-file, as if the client had left. Here,
  once the whole request has arrived, end-of-file only stops reading: the server sends an interim
  ``100 Continue`` (which every HTTP/1.1 client skips) and watches the socket; a client that has
  really gone answers it with a reset, and its request is cancelled at once;
* while a request is in progress the socket is checked every :data:`WATCH_INTERVAL_S` seconds: a
  client whose connection was reset (it closed with our answer unread) is noticed even while the
  server is neither reading nor writing (a bulk stream busy with its records);
* a request head that is not valid HTTP gets a JSON 400, not text;
* each request starts with an empty log context: a request read while the previous one on the
  same connection was finishing (pipelined, or kept alive) never logs under the previous one's id.

Request-body timeouts are the application's (server/body.py): it knows which routes read bodies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from clef_vllm.util.logs import LOG_CONTEXT

log = logging.getLogger("clef_vllm.server")

_TCP_CLOSE = 7
_PROBE_DELAYS = (0.02, 0.1, 0.3, 1.0)
WATCH_INTERVAL_S = 1.0
#: Connections accepted beyond ``max_connections`` for the probes only.
PROBE_CONNECTIONS = 8
#: The scope extension that marks a request read on one of those connections (server/middleware.py).
PROBE_ONLY = "clef.probe_only"


@dataclass
class ConnectionRules:
    header_timeout: float | None = 10.0
    max_connections: int | None = None


def raw_json_response(status: int, reason: str, message: str) -> bytes:
    """A complete ``Connection: close`` JSON response, written outside of h11's state machine."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": status}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


def protocol_class(rules: ConnectionRules) -> type[H11Protocol]:
    """uvicorn's ``http=`` protocol class with ``rules`` applied."""
    return type("ClefH11Protocol", (ClefH11Protocol,), {"rules": rules})


class ClefH11Protocol(H11Protocol):
    rules = ConnectionRules()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._header_timer = None
        self._head_bytes = 0
        self._half_closed = False
        self._probes = []
        self.closed = asyncio.Event()          # the application can wait on it: the client is gone
        self._watch = None
        self._probe_only = False               # one of the PROBE_CONNECTIONS

    # ---------------------------------------------------------------- connection limits and head timeout

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        limit = self.rules.max_connections
        if limit is not None and len(self.connections) > limit + PROBE_CONNECTIONS:
            log.warning("connection refused: %d connections are open (--max-connections %d, and %d for probes)",
                        len(self.connections) - 1, limit, PROBE_CONNECTIONS)
            transport.write(raw_json_response(503, "Service Unavailable",
                                              f"too many open connections (--max-connections {limit})"))
            transport.close()
            return
        self._probe_only = limit is not None and len(self.connections) > limit
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._head_bytes += len(data)
        super().data_received(data)
        self._tag_scope()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_header_timer()
        else:
            self._disarm_header_timer()
            self._head_bytes = 0

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and self.rules.header_timeout:
            self._header_timer = self.loop.call_later(self.rules.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self._head_bytes:
            log.info("closing a connection that did not send its request head within %g s (--header-timeout)",
                     self.rules.header_timeout)
            self.transport.write(raw_json_response(
                408, "Request Timeout", f"request head not received within {self.rules.header_timeout:g} s "
                                        "(--header-timeout)"))
        self.transport.close()

    def _tag_scope(self) -> None:
        """Give the application a way to close this connection (a bulk client that stopped reading) and
        to learn at once that it closed (a bulk stream that is not reading its body at that moment)."""
        scope = self.scope
        if scope is not None and "clef.close_connection" not in scope.setdefault("extensions", {}):
            scope["extensions"]["clef.close_connection"] = self.transport.abort
            scope["extensions"]["clef.close_when_sent"] = self.transport.close
            scope["extensions"]["clef.closed"] = self.closed
            if self._probe_only:
                scope["extensions"][PROBE_ONLY] = True

    def handle_events(self) -> None:
        # Called from the previous request's task when it completes (uvicorn then reads the next request
        # on the connection): the next request's task must not inherit that request's log context.
        token = LOG_CONTEXT.set({})
        try:
            super().handle_events()
        finally:
            LOG_CONTEXT.reset(token)
        self._tag_scope()
        if self._watch is None and self.cycle is not None and not self.cycle.response_complete:
            self._watch = self.loop.call_later(WATCH_INTERVAL_S, self._watch_peer)

    def _watch_peer(self) -> None:
        self._watch = None
        if self.transport.is_closing() or self.cycle is None or self.cycle.response_complete:
            return
        if self._peer_reset():
            self.transport.abort()
            return
        self._watch = self.loop.call_later(WATCH_INTERVAL_S, self._watch_peer)

    def _peer_reset(self) -> bool:
        """Whether the kernel has seen the peer reset this connection (TCP state CLOSE, or an error)."""
        sock = self.transport.get_extra_info("socket")
        try:
            state = struct.unpack("B", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[:1])[0]
            return state == _TCP_CLOSE or bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
        except (OSError, AttributeError, struct.error):
            return False

    def connection_lost(self, exc) -> None:
        self.closed.set()
        if self._watch is not None:
            self._watch.cancel()
        self._disarm_header_timer()
        for probe in self._probes:
            probe.cancel()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self.transport.write(raw_json_response(400, "Bad Request", f"invalid HTTP request: {msg}"))
        self.transport.close()

    # ---------------------------------------------------------------- half-closed clients

    def eof_received(self):
        cycle = self.cycle
        if (cycle is not None and not cycle.response_complete and not cycle.disconnected
                and self.conn.their_state is h11.DONE):
            # The whole request is here and its answer is not: keep the connection open for the answer.
            self._half_closed = True
            self._disarm_header_timer()
            if not cycle.response_started and self.scope.get("http_version") == "1.1":
                try:
                    self.transport.write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[],
                                                                                   reason=b"Continue")))
                except h11.LocalProtocolError:
                    pass
            for delay in _PROBE_DELAYS:
                self._probes.append(self.loop.call_later(delay, self._check_peer))
            return True
        return None

    def _check_peer(self) -> None:
        """After end-of-file: abort the request if the peer answered our bytes with a reset (it is gone)."""
        if self.transport.is_closing() or self.cycle is None or self.cycle.response_complete:
            return
        if self._peer_reset():
            self.transport.abort()
        elif self._probes and all(p.cancelled() or p.when() <= self.loop.time() for p in self._probes):
            self._probes = [self.loop.call_later(_PROBE_DELAYS[-1], self._check_peer)]

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._half_closed and not self.transport.is_closing():
            self.transport.close()          # the client sends nothing more
