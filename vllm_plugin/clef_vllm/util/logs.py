"""Logging for the server and the engine processes it starts: text or one JSON object per line, with the request id on every line.

The request id (and, inside a bulk stream, the record index) lives in a context variable that
the HTTP middleware sets; a filter copies it onto every log record emitted while serving that
request, whatever the logger. Request bodies are never logged. In JSON mode transformers' logs
are routed here too; vLLM configures its own handlers (``VLLM_LOGGING_CONFIG_PATH`` changes them).
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time

#: ``LEVEL:FORMAT`` of the server's logging, for the engine processes it starts (:func:`inherit_logging`).
LOG_ENV = "CLEF_VLLM_LOG"

LOG_CONTEXT: contextvars.ContextVar[dict] = contextvars.ContextVar("clef_log_context", default={})  # noqa: B039 - never mutated, only set

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is a field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "color_message",
                                                                         "taskName"}


class ContextFilter(logging.Filter):
    """Copies the current request's log context (``request_id``, ``record``) onto each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in LOG_CONTEXT.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def _fields(record: logging.LogRecord) -> dict:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "message", "request_id"?, ...extra fields, "exc"?}`` per line."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)       # ASCII: no raw U+2028 etc. inside a line


class TextFormatter(logging.Formatter):
    """``time LEVEL logger [request-id#record]: message key=value...``."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s%(context)s: %(message)s%(extras)s")

    def format(self, record: logging.LogRecord) -> str:
        fields = _fields(record)
        rid, rec = fields.pop("request_id", None), fields.pop("record", None)
        record.context = "" if rid is None else f" [{rid}{'' if rec is None else f'#{rec}'}]"
        record.extras = "".join(f" {k}={v}" for k, v in fields.items() if k not in ("context", "extras"))
        return super().format(record)


def _handler(fmt: str) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    return handler


def inherit_logging() -> bool:
    """In a process the server started without forking it (vLLM spawns its engine core once the front end holds
    a CUDA context, e.g. with a vision tower's processor), the server's handler for the ``clef_vllm`` loggers:
    a forked process inherits the root handler, a spawned one starts with none and would drop every line below
    WARNING (the memory budget's among them). Returns whether it set one up."""
    setting = os.environ.get(LOG_ENV)
    if not setting or logging.getLogger().handlers:
        return False
    logger = logging.getLogger("clef_vllm")
    if logger.handlers:
        return False
    level, _, fmt = setting.partition(":")
    logger.addHandler(_handler(fmt or "text"))
    logger.setLevel(level.upper() or "INFO")
    logger.propagate = False
    return True


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """One stderr handler on the root logger (uvicorn's loggers propagate to it); the engine processes the
    server starts log the plugin's lines the same way (:func:`inherit_logging`)."""
    os.environ[LOG_ENV] = f"{level}:{fmt}"
    handler = _handler(fmt)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    logging.captureWarnings(True)          # Python warnings become log lines (JSON in json mode)
    if fmt == "json":
        try:                               # transformers logs through its own stderr handler by default
            from transformers.utils import logging as hf_logging

            hf_logging.disable_default_handler()
            hf_logging.enable_propagation()
        except ImportError:
            pass
