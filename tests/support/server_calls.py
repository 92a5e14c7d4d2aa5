"""Calls on a live ``clef-systemone`` (:class:`clef_vllm.testing.server.LiveServer`) for the server tests:
POST a decision, check an error body, read ``/metrics``, poll a state, and a bare HTTP/1.1 client for
streamed or half-sent bodies.

Nothing here waits on a duration: :func:`wait_until` polls a state with a bound that only stops a hang.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx

from clef_vllm.testing.server import LiveServer

NDJSON = {"Content-Type": "application/x-ndjson"}


def post(server: LiveServer, body=None, *, content=None, headers=None) -> httpx.Response:
    """POST ``body`` (JSON) or raw ``content`` to ``/v1/systemone``."""
    if content is None:
        content = json.dumps(body).encode()
    return httpx.post(server.url + "/v1/systemone", content=content, timeout=60,
                      headers={"Content-Type": "application/json", **(headers or {})})


def assert_error(resp: httpx.Response, status: int, *fragments, param="ANY") -> dict:
    """``resp`` is the reference dialect's error body with ``status``, its message holding every fragment."""
    assert resp.status_code == status, resp.text
    assert "Traceback" not in resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    assert body["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")
    for fragment in fragments:
        assert fragment in body["error"]["message"], body
    if param != "ANY":
        assert body["error"]["param"] == param, body
    return body


def metrics_of(server: LiveServer, headers=None) -> dict:
    """``{(sample name, sorted label items): value}`` from ``GET /metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = httpx.get(server.url + "/metrics", headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


def metric(server: LiveServer, name: str, **labels) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in metrics_of(server).items()
               if n == name and all(dict(ls).get(k) == str(w) for k, w in labels.items()))


def wait_until(predicate, what: str, timeout: float = 60.0) -> None:
    """Poll ``predicate`` until it holds; ``timeout`` only stops a hang."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def held(name: str, **fields) -> dict:
    """A request that stays in the engine until the test creates ``HOLD_DIR/name`` (the ``hold_dir`` fault hook)."""
    return {"model": "clef-flash", "state": f"held {name}", "questions": {f"hold.{name}": {"type": "noul"}}, **fields}


def release(holds: Path, *names: str) -> None:
    """Let the held requests ``names`` finish."""
    for name in names:
        (holds / name).touch()


def server_timing(resp: httpx.Response) -> dict[str, float]:
    """The ``Server-Timing`` header's stages, in order: ``{name: milliseconds}``."""
    out = {}
    for part in resp.headers["server-timing"].split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur)
    return out


def health_code(server: LiveServer) -> int | None:
    """``/health``'s status, or None while nothing listens."""
    try:
        return httpx.get(server.url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


class RawHttp:
    """A bare HTTP/1.1 client: stream a request body and read the response while still sending it
    (httpx writes the whole body before it reads), or send part of a body and stop."""

    def __init__(self, server: LiveServer, path: str, headers: dict | None = None, content_length: int | None = None):
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        self.reader = self.sock.makefile("rb")
        self.chunked = content_length is None
        media = "application/x-ndjson" if path.endswith("/bulk") else "application/json"
        head = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{server.port}", f"Content-Type: {media}",
                *(f"{k}: {v}" for k, v in (headers or {}).items()),
                "Transfer-Encoding: chunked" if self.chunked else f"Content-Length: {content_length}"]
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        self._buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)

    def send_line(self, obj) -> None:
        self.send((obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n")

    def end(self) -> None:
        if self.chunked:
            self.sock.sendall(b"0\r\n\r\n")

    def response_head(self) -> tuple[int, dict]:
        status = int(self.reader.readline().split()[1])
        headers = {}
        while (line := self.reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        return status, headers

    def read_line(self) -> dict:
        """The next NDJSON line of a chunked response."""
        while b"\n" not in self._buf:
            size = int(self.reader.readline().strip(), 16)
            if size == 0:
                raise EOFError("response ended")
            self._buf += self.reader.read(size)
            self.reader.readline()
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def read_json_response(self) -> tuple[int, dict]:
        status, headers = self.response_head()
        return status, json.loads(self.reader.read(int(headers["content-length"])))

    def close(self) -> None:
        self.reader.close()
        self.sock.close()
