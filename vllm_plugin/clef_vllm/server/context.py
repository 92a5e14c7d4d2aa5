"""Per-request context: request id, stage timings (``Server-Timing``), outcome reason, error types.

Stages, in seconds (``Server-Timing`` shows milliseconds):

* ``parse``: decoding and validating the body (CPU pool);
* ``queue``: waiting for an engine slot (admission control);
* ``encode``: tokenization and span layout;
* ``engine``: the backend call, everything it does included;
* ``batch_wait``, ``backbone``, ``head``: parts of ``engine`` that a micro-batching backend can
  tell apart (reference backend). They describe the whole micro-batch the request ran in;
* ``total``: from the first byte of the request to the response headers.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from dataclasses import dataclass, field

from clef_vllm.schema.protocol import Dialect

#: Where the HTTP middleware keeps a request's :class:`RequestContext` (``scope["state"]``).
CONTEXT_KEY = "clef_ctx"
STAGES = ("parse", "queue", "encode", "batch_wait", "backbone", "head", "engine", "total")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def accept_request_id(value: str | None) -> str:
    """The client's ``X-Request-Id`` if it is sane (``[A-Za-z0-9._:-]{1,128}``), else a new one."""
    if value and _REQUEST_ID.fullmatch(value):
        return value
    return uuid.uuid4().hex


class WorkCancelled(Exception):
    """Raised inside CPU work whose request no longer needs it."""


@dataclass
class RequestContext:
    """Everything the server tracks about one request (or one bulk record)."""

    request_id: str
    route: str
    started: float = field(default_factory=time.perf_counter)
    stages: dict[str, float] = field(default_factory=dict)
    reason: str = "ok"
    timeout_s: float | None = None
    input_tokens: int | None = None
    questions: int | None = None
    record: int | None = None          # line index inside a bulk stream
    dialect: Dialect | None = None     # this request's dialect; None: the server's --dialect
    default_model: str | None = None   # the body's "model" when it has none (hosted route)
    cancelled: threading.Event = field(default_factory=threading.Event)   # stop its CPU work (pool threads)
    body_bytes: int = 0
    values_counted: bool = False       # the body's JSON values were counted while it was read

    def checkpoint(self) -> None:
        """Called by CPU work between steps: stops it once the request is cancelled (timeout, client gone)."""
        if self.cancelled.is_set():
            raise WorkCancelled()

    def add_stage(self, name: str, seconds: float) -> None:
        self.stages[name] = self.stages.get(name, 0.0) + max(0.0, seconds)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def server_timing(self) -> str:
        """``Server-Timing`` value: every stage reached so far plus ``total`` (milliseconds)."""
        stages = dict(self.stages, total=self.elapsed())
        return ", ".join(f"{name};dur={stages[name] * 1000:.2f}" for name in STAGES if name in stages)
