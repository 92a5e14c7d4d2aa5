"""FastAPI app: ``POST /v1/systemone``, ``POST /v1/systemone/bulk``, ``GET /health``,
``GET /health/live``, ``GET /metrics``, ``GET /v1/models``, and Workers AI's REST route
``POST [/client/v4]/accounts/{account_id}/ai/run/{model_name}`` (server/hosted.py); OpenAPI at ``/docs``.

The model loads in the background after the server starts listening, so ``/health`` can say
503 ("loading") instead of refusing connections; it says 200 only once requests can be served,
and 503 again while draining (SIGTERM) or after the engine failed. Client mistakes map to 400
(malformed JSON), 401 (API key), 413 (too large / too long), 422 (invalid, field named); the
server's own limits to 429 (at capacity, with ``Retry-After``), 503 (not ready, draining, engine
failed) and 504 (timed out). Nothing a client sends produces a 500 or a stack trace.
See docs/operating.md.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from clef_vllm import __version__
from clef_vllm.backends.base import Backend
from clef_vllm.protocol import ChoiceAnswer, NoulAnswer, RequestError, ScoreAnswer, SystemOneRequest, SystemOneResponse
from clef_vllm.server.body import decode_json, read_body  # noqa: F401 - decode_json is part of this module's API
from clef_vllm.server.bulk import BulkStream
from clef_vllm.server.context import ServerError, reason_of
from clef_vllm.server.hosted import install_hosted_routes
from clef_vllm.server.metrics import ServerMetrics
from clef_vllm.server.middleware import CONTEXT_KEY, BearerAuth, EdgeMiddleware, error_response
from clef_vllm.server.service import FAILED, READY, DecisionService
from clef_vllm.server.settings import DEFAULT_MAX_BODY_BYTES, ServerSettings  # noqa: F401 - re-exported

log = logging.getLogger("clef_vllm.server")


def create_app(load_backend: Callable[[], Backend], settings: ServerSettings | None = None) -> FastAPI:
    """Build the app. ``load_backend`` runs in a worker thread after startup (it may take minutes)."""
    settings = settings or ServerSettings()
    metrics = ServerMetrics(settings.near_tie_margin)
    service = DecisionService(settings, metrics)
    dialect = settings.dialect

    async def lifespan(app: FastAPI):
        task = asyncio.create_task(service.run(load_backend))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await service.close()

    app = FastAPI(title="clef-vllm SystemOne server", version=__version__, lifespan=lifespan,
                  description="Clef-Flash decisions over the SystemOne protocol (`POST /v1/systemone`).")
    app.state.clef = service

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        ctx = request.scope["state"][CONTEXT_KEY]
        ctx.reason = reason_of(exc)
        return error_response(exc, ctx.dialect)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        ctx = request.scope["state"][CONTEXT_KEY]
        message = {404: "no such route", 405: "method not allowed"}.get(exc.status_code, str(exc.detail))
        return error_response(RequestError(message, status=exc.status_code), ctx.dialect, exc.headers)

    @app.get("/health", summary="200 once the model is loaded and serving; 503 while loading, draining or failed")
    async def health():
        if service.status == READY:
            return {"status": "ok"}
        return JSONResponse({"status": service.status}, status_code=503)

    @app.get("/health/live", summary="Liveness: 200 unless the model failed to load or the engine died")
    async def live():
        if service.status == FAILED:
            return JSONResponse({"status": FAILED}, status_code=503)
        return {"status": service.status}

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", summary="The served model and backend, once per name (--served-model-name)")
    async def models():
        info = service.backend.describe() if service.backend is not None else {}
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "clef-vllm",
                                             "clef_vllm_version": __version__, **info}
                                            for name in settings.served_models]}

    @app.post("/v1/systemone", summary="Answer every question of a SystemOne request in one forward pass",
              response_model=None, responses=_openapi_responses(),
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/SystemOneRequest"}}}}})
    async def systemone(request: Request) -> Response:
        ctx = request.scope["state"][CONTEXT_KEY]
        service.check_accepting()
        with service.track():
            ctx.timeout_s = settings.request_timeout_s
            raw = await read_body(request, settings.max_body_bytes)
            payload = await service.answer_unless_disconnected(decode_json(raw), ctx, request.receive)
        return JSONResponse(payload)

    @app.post("/v1/systemone/bulk", summary="Stream many requests: NDJSON in, one NDJSON line per record as it "
              "finishes", response_model=None, responses=_bulk_openapi_responses(),
              openapi_extra={"requestBody": {"required": True, "content": {"application/x-ndjson": {
                  "schema": {"type": "string", "description": "One SystemOneRequest JSON object per line"}}}}})
    async def bulk(request: Request) -> Response:
        ctx = request.scope["state"][CONTEXT_KEY]
        service.check_accepting()
        if service.bulk_streams >= settings.max_bulk_streams:
            raise ServerError(f"{service.bulk_streams} bulk streams are open (--max-bulk-streams)", status=429,
                              reason="bulk_streams", headers={"Retry-After": str(service.admission.retry_after())})
        ctx.timeout_s = settings.request_timeout_s
        return BulkStream(service, ctx)

    install_hosted_routes(app, settings.served_models, systemone)

    app.add_middleware(EdgeMiddleware, metrics=metrics, dialect=dialect,
                       auth=BearerAuth(settings.api_keys, settings.auth_health_metrics))
    if settings.cors_origins:             # added last = outermost: preflights never need the API key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["Server-Timing", "X-Request-Id", "Retry-After"])
    _install_openapi(app)
    return app


def _openapi_responses() -> dict:
    err = {"description": "Error body: {error: {message, type, param, code}} (workers-ai dialect: hosted envelope)"}
    return {200: {"description": "Answers", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/SystemOneResponse"}}}},
            400: err, 401: err, 413: err, 422: err, 429: err, 503: err, 504: err}


def _bulk_openapi_responses() -> dict:
    err = {"description": "Error body (the stream did not start)"}
    return {200: {"description": 'NDJSON: {"index", "status", "body"} per record as it finishes, then {"summary"}',
                  "content": {"application/x-ndjson": {"schema": {"type": "string"}}}},
            400: err, 401: err, 429: err, 503: err}


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
