"""Per-request context: request id, stage timings (``Server-Timing``), outcome reason, error types.

Stages, in seconds (``Server-Timing`` shows milliseconds):

* ``queue``: waiting for an engine slot (admission control);
* ``encode``: tokenization and span layout;
* ``engine``: the backend call, everything it does included;
* ``batch_wait``, ``backbone``, ``head``: parts of ``engine`` that a micro-batching backend can
  tell apart (reference backend). They describe the whole micro-batch the request ran in;
* ``total``: from the first byte of the request to the response headers.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field

from clef_vllm.protocol import Dialect, RequestError

#: Where the HTTP middleware keeps a request's :class:`RequestContext` (``scope["state"]``).
CONTEXT_KEY = "clef_ctx"
STAGES = ("queue", "encode", "batch_wait", "backbone", "head", "engine", "total")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def accept_request_id(value: str | None) -> str:
    """The client's ``X-Request-Id`` if it is sane (``[A-Za-z0-9._:-]{1,128}``), else a new one."""
    if value and _REQUEST_ID.fullmatch(value):
        return value
    return uuid.uuid4().hex


class ServerError(RequestError):
    """An error the server decides (limits, overload, timeouts, engine failure), with a metrics reason."""

    def __init__(self, message: str, *, status: int, reason: str, field: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message, field=field, status=status)
        self.reason = reason
        self.headers = headers or {}


_REASONS = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
            413: "too_large", 422: "invalid", 429: "overloaded", 500: "internal", 503: "unavailable",
            504: "timeout"}


def reason_of(exc: BaseException) -> str:
    """A short, bounded label for metrics and logs (never client text)."""
    reason = getattr(exc, "reason", None)
    if reason:
        return reason
    return _REASONS.get(getattr(exc, "status", 500), "error")


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

    def add_stage(self, name: str, seconds: float) -> None:
        self.stages[name] = self.stages.get(name, 0.0) + max(0.0, seconds)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def server_timing(self) -> str:
        """``Server-Timing`` value: every stage reached so far plus ``total`` (milliseconds)."""
        stages = dict(self.stages, total=self.elapsed())
        return ", ".join(f"{name};dur={stages[name] * 1000:.2f}" for name in STAGES if name in stages)
