"""Reading and decoding request bodies: size cap, strict JSON."""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request

from clef_vllm.protocol import RequestError
from clef_vllm.server.context import ServerError


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:32]} is out of range")
    return value


def decode_json(raw: bytes | str) -> Any:
    """Strict JSON (no NaN/Infinity, no number overflowing to infinity); raises RequestError(400)."""
    try:
        return json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError) as exc:
        raise RequestError(f"body is not valid JSON: {exc}", status=400) from None
    except RecursionError:
        raise RequestError("body is not valid JSON: nested too deeply", status=400) from None


def body_too_large(limit: int) -> ServerError:
    return ServerError(f"body exceeds {limit} bytes (--max-body-bytes)", status=413, reason="body_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it passes ``limit`` bytes (declared or streamed)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)
