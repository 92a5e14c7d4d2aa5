"""Request bodies built to hit the server's structural limits (the adversarial tests and ``bench/soak.py``'s
mix send them)."""

from __future__ import annotations


def nested_level(depth: int) -> bytes:
    """A score question whose one level is an array nested ``depth`` deep."""
    return ('{"model":"m","state":1,"questions":{"a":{"type":"score","criteria":['
            + "[" * depth + "]" * depth + "]}}}").encode()


def state_array(size: int) -> bytes:
    """A state that is one array of ``size`` bytes of ``1,``: more JSON values than any request can use."""
    head, tail = b'{"model":"m","questions":{"a":{"type":"noul"}},"state":[', b"1]}"
    return head + b"1," * ((size - len(head) - len(tail)) // 2) + tail
