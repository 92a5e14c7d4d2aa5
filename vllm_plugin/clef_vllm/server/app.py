"""FastAPI app: ``POST /v1/systemone``, ``POST /v1/systemone/bulk``, OpenAI's ``POST /v1/decisions``
and ``POST /v1/decisions/bulk`` (server/decisions.py), ``GET /health``,
``GET /health/live``, ``GET /metrics``, ``GET /v1/models``, Workers AI's REST route
``POST [/client/v4]/accounts/{account_id}/ai/run/{model_name}`` (server/hosted.py); API
documentation at ``/docs`` and ``/redoc`` (assets served by this server: no CDN), OpenAPI at
``/openapi.json``.

The model loads in the background after the server starts listening, so ``/health`` can say
503 ("loading") instead of refusing connections; it says 200 only once requests can be served,
and 503 again while draining (SIGTERM) or after the engine failed. Every error is a
:class:`~clef_vllm.schema.errors.ClefError` whose kind maps to a status in ONE table
(``server/errors.py``). Nothing a client sends produces a 500 or a stack trace.
POST bodies must declare their media type: ``application/json`` (``NDJSON_TYPES`` for the bulk
endpoint), else 415. Trailing-slash redirects are off (``/health/`` is 404).
See docs/operating.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.staticfiles import StaticFiles

from clef_vllm.backends.base import Backend
from clef_vllm.schema.errors import ClefError, ClientClosed, Kind
from clef_vllm.schema.protocol import ChoiceAnswer, NoulAnswer, ScoreAnswer, SystemOneRequest, SystemOneResponse
from clef_vllm.server.body import (HOSTED_TYPES, JSON_TYPES, NDJSON_TYPES, check_content_encoding,  # noqa: F401 - API
                                   check_media_type, decode_json)
from clef_vllm.server.bulk import BulkStream
from clef_vllm.server.decisions import install_decisions_routes
from clef_vllm.server.errors import error_response, from_http_exception, outcome
from clef_vllm.server.hosted import hosted_path, install_hosted_routes
from clef_vllm.server.metrics import ServerMetrics
from clef_vllm.server.middleware import CONTEXT_KEY, DOCS_ASSETS, BearerAuth, EdgeMiddleware
from clef_vllm.server.service import FAILED, READY, DecisionService
from clef_vllm.server.settings import DEFAULT_MAX_BODY_BYTES, ServerSettings  # noqa: F401 - re-exported
from clef_vllm.version import __version__

log = logging.getLogger("clef_vllm.server")


def create_app(load_backend: Callable[[], Backend], settings: ServerSettings | None = None) -> FastAPI:
    """Build the app. ``load_backend`` runs in a worker thread after startup (it may take minutes)."""
    settings = settings or ServerSettings()
    metrics = ServerMetrics(settings.near_tie_margin)
    service = DecisionService(settings, metrics)
    dialect = settings.dialect
    started = int(time.time())

    async def lifespan(app: FastAPI):
        task = asyncio.create_task(service.run(load_backend))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await service.close()

    app = FastAPI(title="clef-vllm SystemOne server", version=__version__, lifespan=lifespan,
                  description="Clef-Flash decisions over the SystemOne protocol (`POST /v1/systemone`).",
                  docs_url=None, redoc_url=None, swagger_ui_oauth2_redirect_url=None, redirect_slashes=False,
                  dependencies=[Depends(require_media_type)])
    app.state.clef = service

    @app.exception_handler(ClefError)
    async def _clef_error(request: Request, exc: ClefError):
        ctx = request.scope["state"][CONTEXT_KEY]
        ctx.reason = outcome(exc).reason
        if isinstance(exc, ClientClosed):          # nobody is listening; the edge counts it as 499
            return Response(status_code=499)
        return error_response(exc, ctx.dialect)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        ctx = request.scope["state"][CONTEXT_KEY]
        error = from_http_exception(exc)
        ctx.reason = outcome(error).reason
        return error_response(error, ctx.dialect, exc.headers)

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
        return {"object": "list", "data": [{"id": name, "object": "model", "created": started, "owned_by": "clef-vllm",
                                             "clef_vllm_version": __version__, **info}
                                            for name in settings.served_models]}

    @app.get("/v1/models/{model_name:path}", summary="One served name's entry of /v1/models (404 for another)")
    async def model(model_name: str):
        for entry in (await models())["data"]:
            if entry["id"] == model_name:
                return entry
        raise ClefError(f"no model {model_name[:200]!r}: this server runs "
                        f"{', '.join(map(repr, settings.served_models))} (--served-model-name)", kind=Kind.NOT_FOUND)

    @app.post("/v1/systemone", summary="Answer every question of a SystemOne request in one forward pass",
              response_model=None, responses=_openapi_responses(),
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/SystemOneRequest"}}}}})
    async def systemone(request: Request) -> Response:
        ctx = request.scope["state"][CONTEXT_KEY]
        service.check_accepting()
        with service.track(), service.holding_body(ctx):
            ctx.timeout_s = settings.request_timeout_s
            content = await service.answer_unless_gone(
                await service.read_body(request.receive, ctx, request.headers.get("content-length")), ctx,
                request.receive)
        return Response(content, media_type="application/json")

    @app.post("/v1/systemone/bulk", summary="Stream many requests: NDJSON in, one NDJSON line per record as it "
              "finishes", response_model=None, responses=_bulk_openapi_responses(),
              openapi_extra={"requestBody": {"required": True, "content": {"application/x-ndjson": {
                  "schema": {"type": "string", "description": "One SystemOneRequest JSON object per line"}}}}})
    async def bulk(request: Request) -> Response:
        ctx = request.scope["state"][CONTEXT_KEY]
        service.check_accepting()
        ctx.timeout_s = settings.request_timeout_s
        return BulkStream(service, ctx)

    install_hosted_routes(app, settings.served_models, systemone)
    install_decisions_routes(app, systemone, bulk)
    _install_docs(app)

    app.add_middleware(EdgeMiddleware, metrics=metrics, dialect=dialect,
                       auth=BearerAuth(settings.api_keys, settings.auth_health_metrics))
    if settings.cors_origins:             # added last = outermost: preflights never need the API key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["Server-Timing", "X-Request-Id", "Retry-After"])
    _install_openapi(app)
    return app


#: POST routes whose body is NDJSON; every other POST route takes ``application/json``.
NDJSON_ROUTES = frozenset({"/v1/systemone/bulk", "/v1/decisions/bulk"})


async def require_media_type(request: Request) -> None:
    """Every POST body must say what it is (415 otherwise): see ``check_media_type``. The hosted
    route also takes ``curl -d``'s form type, as the hosted API does (``HOSTED_TYPES``). A body
    must not be compressed (415: ``check_content_encoding``)."""
    if request.method == "POST":
        check_content_encoding(request.headers.get("content-encoding"))
        path = request.url.path
        accepted = NDJSON_TYPES if path in NDJSON_ROUTES else HOSTED_TYPES if hosted_path(path) else JSON_TYPES
        check_media_type(request.headers.get("content-type"), accepted)


def _openapi_responses() -> dict:
    err = {"description": "Error body: {error: {message, type, param, code}} (workers-ai dialect: hosted envelope)"}
    return {200: {"description": "Answers", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/SystemOneResponse"}}}},
            400: err, 401: err, 408: err, 413: err, 415: err, 422: err, 429: err, 503: err, 504: err}


def _bulk_openapi_responses() -> dict:
    err = {"description": "Error body (the stream did not start)"}
    return {200: {"description": 'NDJSON: {"index", "status", "body"} per record as it finishes, then {"summary"}',
                  "content": {"application/x-ndjson": {"schema": {"type": "string"}}}},
            400: err, 401: err, 408: err, 415: err, 429: err, 503: err}


def _install_docs(app: FastAPI) -> None:
    """``/docs`` (Swagger UI) and ``/redoc`` with their JavaScript, CSS and icon served from the
    ``fastapi-offline`` package: the pages work on a machine without internet access. Without that
    package (an install that skipped a dependency) the server still serves, without the two pages."""
    try:
        import fastapi_offline
    except ImportError:
        log.warning("fastapi-offline is not installed: /docs and /redoc are off (/openapi.json is served); "
                    "pip install fastapi-offline to get them")
        return

    assets = Path(fastapi_offline.__file__).parent / "static"
    app.mount(DOCS_ASSETS.rstrip("/"), StaticFiles(directory=assets), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - Swagger UI",
                                   swagger_js_url=f"{DOCS_ASSETS}swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}favicon.png", oauth2_redirect_url=None)

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{DOCS_ASSETS}redoc.standalone.js",
                              redoc_favicon_url=f"{DOCS_ASSETS}favicon.png", with_google_fonts=False)


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
