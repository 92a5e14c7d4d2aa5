"""FastAPI app: ``POST /v1/systemone``, ``GET /health``, ``GET /v1/models``, OpenAPI at ``/docs``.

The model loads in the background after the server starts listening, so ``/health`` can say
503 ("loading") instead of refusing connections; it says 200 only once requests can be served.
Client mistakes map to 400 (malformed JSON), 413 (too long), 422 (invalid, field named) and
503 (not ready); nothing a client sends produces a 500 or a stack trace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from clef_vllm import __version__
from clef_vllm.answers import build_response, hosted_envelope
from clef_vllm.backends.base import Backend
from clef_vllm.protocol import (ChoiceAnswer, Dialect, NoulAnswer, RequestError, ScoreAnswer, SystemOneRequest,
                                SystemOneResponse, parse_request)

log = logging.getLogger("clef_vllm.server")

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass
class ServerSettings:
    """Everything the app needs besides the backend."""

    dialect: Dialect = Dialect.REFERENCE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    served_model: str = "clef-flash"
    on_ready: Callable[[], None] | None = None
    on_load_error: Callable[[BaseException], None] | None = None


class _State:
    def __init__(self):
        self.backend: Backend | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:32]} is out of range")
    return value


def decode_json(raw: bytes) -> Any:
    """Strict JSON (no NaN/Infinity, no number overflowing to infinity); raises RequestError(400)."""
    try:
        return json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError) as exc:
        raise RequestError(f"body is not valid JSON: {exc}", status=400) from None
    except RecursionError:
        raise RequestError("body is not valid JSON: nested too deeply", status=400) from None


def create_app(load_backend: Callable[[], Backend], settings: ServerSettings | None = None) -> FastAPI:
    """Build the app. ``load_backend`` runs in a worker thread after startup (it may take minutes)."""
    settings = settings or ServerSettings()
    state = _State()
    dialect = settings.dialect

    def error_response(exc: RequestError, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(exc.body(dialect), status_code=exc.status, headers=headers)

    async def load() -> None:
        try:
            backend = await asyncio.to_thread(load_backend)
            await backend.start()
            state.backend = backend
            state.ready.set()
            log.info("ready: %s", backend.describe())
            if settings.on_ready is not None:
                settings.on_ready()
        except BaseException as exc:  # noqa: BLE001 - reported through /health and the exit code
            state.error = exc
            log.error("model failed to load: %s", exc)
            if settings.on_load_error is not None:
                settings.on_load_error(exc)

    async def lifespan(app: FastAPI):
        task = asyncio.create_task(load())
        app.state.clef = state
        try:
            yield
        finally:
            task.cancel()
            if state.backend is not None:
                await asyncio.to_thread(state.backend.close)

    app = FastAPI(title="clef-vllm SystemOne server", version=__version__, lifespan=lifespan,
                  description="Clef-Flash decisions over the SystemOne protocol (`POST /v1/systemone`).")

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return error_response(RequestError("internal server error", status=500))

    @app.get("/health", summary="200 once the model is loaded and serving; 503 while loading or failed")
    async def health():
        if state.ready.is_set():
            return {"status": "ok"}
        status = "failed" if state.error is not None else "loading"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/v1/models", summary="The served model and backend")
    async def models():
        info = state.backend.describe() if state.backend is not None else {}
        return {"object": "list", "data": [{"id": settings.served_model, "object": "model", "owned_by": "clef-vllm",
                                             "clef_vllm_version": __version__, **info}]}

    @app.post("/v1/systemone", summary="Answer every question of a SystemOne request in one forward pass",
              response_model=None, responses=_openapi_responses(),
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/SystemOneRequest"}}}}})
    async def systemone(request: Request) -> Response:
        started = time.perf_counter()
        if not state.ready.is_set():
            raise RequestError("model is not ready" if state.error is None else "model failed to load", status=503)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise RequestError(f"body exceeds {settings.max_body_bytes} bytes", status=413)
        raw = await _read_body(request, settings.max_body_bytes)
        body = decode_json(raw)
        parsed = parse_request(body, dialect)
        backend = state.backend
        encoded = await run_in_threadpool(backend.encoder.encode, parsed)
        probs = await backend.decide(encoded)
        payload = build_response(parsed, encoded, probs, dialect)
        if dialect is Dialect.WORKERS_AI:
            payload = hosted_envelope(payload)
        elapsed = (time.perf_counter() - started) * 1000
        return JSONResponse(payload, headers={"Server-Timing": f"total;dur={elapsed:.2f}"})

    _install_openapi(app)
    return app


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"body exceeds {limit} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def _openapi_responses() -> dict:
    err = {"description": "Error body: {error: {message, type, param, code}} (workers-ai dialect: hosted envelope)"}
    return {200: {"description": "Answers", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/SystemOneResponse"}}}},
            400: err, 413: err, 422: err, 503: err}


def _install_openapi(app: FastAPI) -> None:
    """Add the pydantic request/response schemas to the generated OpenAPI document."""
    from fastapi.openapi.utils import get_openapi

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (SystemOneRequest, SystemOneResponse, NoulAnswer, ChoiceAnswer, ScoreAnswer):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
