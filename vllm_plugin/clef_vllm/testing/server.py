"""A real ``clef-systemone`` in a subprocess on loopback, for tests, soaks, fuzz runs and GPU checks.

>>> server = LiveServer(["--model", "demo", "--backend", "reference"]).wait_ready()
>>> status, body = server.call("/v1/models")
>>> server.stop()

The only helper that starts servers: the test suite (``tests/conftest.py``), ``bench/soak.py``,
``tests/fuzz/run_long.py`` and the GPU scripts in ``tests/gpu/`` all use it. Standard library
only (the GPU machine runs it next to a staged vLLM).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable


#: every port :func:`free_port` has handed out in this process
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port that is free on loopback right now and that this process has not been handed before.

    Servers started together (``tests/test_server_lifecycle.py`` starts a dozen at once) each ask for a port
    before any of them binds one, so the system may offer two of them the same free port: they then
    shared a log file (``clef-server-PORT.log``) and one of them could not listen (a CI run lost nine
    tests to that). A port handed out once is never handed out again by this process."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free loopback port that this process has not handed out already")


def http_call(url: str, body: dict | bytes | None = None, timeout: float = 10.0,
              headers: dict | None = None) -> tuple[int, str]:
    """GET (no body) or POST (JSON dict or raw bytes) ``url``: ``(status, text)``; status 0 when no
    HTTP answer came (connection refused, timeout)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, ValueError) as e:   # URLError, connection refused, timeout
        return 0, f"{type(e).__name__}: {e}"


class LiveServer:
    """``python -m clef_vllm.server.cli --port PORT ARGS...`` with its output in a log file.

    ``env`` adds to the environment; ``port`` defaults to a free one; ``log_path`` to
    ``$PYTEST_TMP`` (else the temp folder) ``/clef-server-PORT.log``. ``new_session`` starts it in
    its own process group (so :meth:`kill` also takes the engine processes it started). ``command``
    (given the port, the whole command line) starts another server of this app instead, such as
    ``bench/instant_server.py``; ``args`` are then not used.
    """

    def __init__(self, args: list[str], env: dict | None = None, ready_timeout: float = 120.0, *,
                 port: int | None = None, log_path: str | Path | None = None, new_session: bool = False,
                 command: Callable[[int], list[str]] | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = (command(self.port) if command is not None else
                    [sys.executable, "-m", "clef_vllm.server.cli", "--port", str(self.port), *args])
        self.log_path = Path(log_path) if log_path else (
            Path(os.environ.get("PYTEST_TMP", tempfile.gettempdir())) / f"clef-server-{self.port}.log")
        self.ready_timeout = ready_timeout
        self.new_session = new_session
        self.started = time.monotonic()
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=new_session)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, path: str, body: dict | bytes | None = None, timeout: float = 10.0,
             headers: dict | None = None) -> tuple[int, str]:
        """:func:`http_call` on this server (``path`` like ``/v1/systemone``)."""
        return http_call(self.url + path, body, timeout, headers)

    def wait_ready(self, timeout: float | None = None, poll_s: float = 0.2) -> "LiveServer":
        """Until ``/health`` says 200. Raises RuntimeError if the server exits first, TimeoutError
        after ``timeout`` (default: ``ready_timeout``) seconds; both carry the log's tail."""
        deadline = time.monotonic() + (self.ready_timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if self.call("/health", timeout=2.0)[0] == 200:
                return self
            time.sleep(poll_s)
        raise TimeoutError(f"server not ready after {self.ready_timeout if timeout is None else timeout} s:\n"
                           f"{self.log()[-4000:]}")

    def log(self) -> str:
        """Everything the server wrote so far."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (a graceful drain), then SIGKILL after ``timeout`` seconds; its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def stop_clean(self) -> int:
        """:meth:`stop`, after checking that the server logged no traceback and no internal error (a module
        fixture's teardown: whatever its tests sent, the server never broke)."""
        log = self.log()
        assert "Traceback" not in log and "internal error" not in log, log[-2000:]
        return self.stop()

    def kill(self) -> None:
        """SIGKILL the server (its whole process group when started with ``new_session``)."""
        if self.proc.poll() is None:
            if self.new_session:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()
            self.proc.wait()
