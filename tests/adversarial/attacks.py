"""The hostile clients and bodies of the adversarial suite, shared by the CI tests
(tests/adversarial/test_adversarial.py) and the long runner (tests/adversarial/run_long.py).

Each builder returns raw bytes or drives a raw socket: these clients do what no well-behaved HTTP
library would (stop mid-head, stop mid-body, half-close, never read)."""

from __future__ import annotations

import json
import socket
import time

from clef_vllm.testing.bodies import state_array

MiB = 1024 * 1024


def _filled(head: bytes, item: bytes, tail: bytes, size: int, reserve: int) -> bytes:
    """``head`` + as many ``item % n`` (n = 0, 1, ...) joined by commas as fit in ``size`` bytes, less
    ``reserve`` + ``tail``."""
    out, total, n = [], len(head) + len(tail), 0
    while total < size - reserve:
        piece = item % n
        out.append(piece)
        total += len(piece) + 1
        n += 1
    return head + b",".join(out) + tail


def state_keys(size: int) -> bytes:
    """A state object with as many keys as fit in ``size`` bytes."""
    return _filled(b'{"model":"m","questions":{"a":{"type":"noul"}},"state":{', b'"k%d":1', b"}}", size, 16)


def many_questions(size: int) -> bytes:
    """As many noul questions as fit in ``size`` bytes."""
    return _filled(b'{"model":"m","state":1,"questions":{', b'"%d":{"type":"noul"}', b"}}", size, 32)


def many_options(size: int) -> bytes:
    """One choice question with as many options as fit in ``size`` bytes."""
    return _filled(b'{"model":"m","state":1,"questions":{"a":{"type":"choice","criteria":{', b'"%d":null', b"}}}}",
                   size, 32)


def state_text(size: int) -> bytes:
    """A valid request whose state is one long text (it is answered, the state cut to fit)."""
    head, tail = b'{"model":"m","questions":{"a":{"type":"noul"}},"state":"', b'"}'
    unit = b"Checkout failed again for customer 1234; retrying. "
    return head + unit * ((size - len(head) - len(tail)) // len(unit)) + tail


WORST_CASES = {"state_array": state_array, "state_keys": state_keys, "questions": many_questions,
               "options": many_options, "state_text": state_text}


def connect(port: int, timeout: float = 30.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def head(path: str, port: int, *, content_length: int | None = None, content_type: str = "application/json",
         extra: dict | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Content-Type: {content_type}",
             *(f"{k}: {v}" for k, v in (extra or {}).items()),
             "Transfer-Encoding: chunked" if content_length is None else f"Content-Length: {content_length}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket, deadline_s: float = 30.0) -> tuple[int | None, dict, bytes]:
    """``(status, headers, body)`` of the next final response (1xx skipped); status None if the
    connection closed first. Reads until the body is complete or the peer closes."""
    sock.settimeout(deadline_s)
    data = b""
    while True:
        while b"\r\n\r\n" not in data:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, socket.timeout):
                chunk = b""
            if not chunk:
                return None, {}, data
            data += chunk
        head_bytes, _, rest = data.partition(b"\r\n\r\n")
        lines = head_bytes.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if status < 200:
            data = rest
            continue
        break
    if "content-length" in headers:
        need = int(headers["content-length"])
        while len(rest) < need:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return status, headers, rest[:need]
    while True:                                   # chunked or close-delimited: read to the end
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not chunk:
            break
        rest += chunk
        if rest.endswith(b"0\r\n\r\n"):
            break
    return status, headers, rest


def read_responses(sock: socket.socket, count: int, deadline_s: float = 30.0) -> list[tuple[int, dict, bytes]]:
    """The next ``count`` responses on one connection (pipelined; each with a Content-Length), or as many
    as came before the peer closed: ``(status, headers, body)`` each."""
    sock.settimeout(deadline_s)
    data, out = b"", []
    while len(out) < count:
        head_end = data.find(b"\r\n\r\n")
        if head_end >= 0:
            lines = data[:head_end].decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            end = head_end + 4 + int(headers.get("content-length", "0"))
            if len(data) >= end:
                out.append((int(lines[0].split()[1]), headers, data[head_end + 4:end]))
                data = data[end:]
                continue
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, socket.timeout):
            chunk = b""
        if not chunk:
            break
        data += chunk
    return out


def dechunk(data: bytes) -> bytes:
    out, pos = b"", 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            return out
        size = int(data[pos:end], 16)
        if size == 0:
            return out
        out += data[end + 2:end + 2 + size]
        pos = end + 2 + size + 2


def ndjson(records: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def wait(predicate, timeout: float, what: str, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(every)
