"""The HTTP edge (pure ASGI, so streaming bodies pass untouched): request id, the request's
dialect (``workers-ai`` under the hosted route's prefixes, else ``--dialect``), bearer auth,
``Server-Timing`` and ``X-Request-Id`` headers, the access log line, request metrics, and a
dialect-shaped 500 for anything unexpected."""

from __future__ import annotations

import hmac
import logging

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clef_vllm.protocol import Dialect, RequestError
from clef_vllm.server.context import CONTEXT_KEY, RequestContext, accept_request_id, reason_of
from clef_vllm.server.hosted import HOSTED_DIALECT, HOSTED_ROUTE, hosted_path, hosted_route_label
from clef_vllm.server.logs import LOG_CONTEXT
from clef_vllm.server.metrics import ServerMetrics

log = logging.getLogger("clef_vllm.server")
access_log = logging.getLogger("clef_vllm.access")

#: Routes with their own metrics label; anything else is "other".
ROUTES = ("/v1/systemone", "/v1/systemone/bulk", "/v1/models", "/health", "/health/live", "/metrics",
          "/openapi.json", "/docs")
PROBES = ("/health", "/health/live", "/metrics")
#: Routes whose whole time is observed as ``clef_stage_seconds{stage="total", kind="interactive"}``.
INTERACTIVE_ROUTES = ("/v1/systemone", HOSTED_ROUTE)


def error_response(exc: RequestError, dialect: Dialect, headers: dict | None = None) -> JSONResponse:
    """The error body in the dialect's envelope, with the error's own headers (``Retry-After``)."""
    return JSONResponse(exc.body(dialect), status_code=exc.status,
                        headers={**getattr(exc, "headers", {}), **(headers or {})})


class BearerAuth:
    """``Authorization: Bearer <key>`` against one or more keys, compared in constant time."""

    def __init__(self, keys: tuple[str, ...], protect_probes: bool):
        self.keys = tuple(k.encode("utf-8") for k in keys if k)
        self.protect_probes = protect_probes

    def protects(self, path: str) -> bool:
        if not self.keys:
            return False
        return path.startswith("/v1/") or hosted_path(path) or (self.protect_probes and path in PROBES)

    def allows(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        given = token.strip().encode("latin-1", "replace") if scheme.lower() == "bearer" else b""
        ok = False
        for key in self.keys:                 # no early exit: every key is compared
            ok |= hmac.compare_digest(given, key)
        return ok


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, *, metrics: ServerMetrics, dialect: Dialect, auth: BearerAuth):
        self.app = app
        self.metrics = metrics
        self.dialect = dialect
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path = scope["path"]
        route = path if path in ROUTES else hosted_route_label(path) or "other"
        ctx = RequestContext(accept_request_id(headers.get("x-request-id")), route,
                             dialect=HOSTED_DIALECT if hosted_path(path) else self.dialect)
        scope.setdefault("state", {})[CONTEXT_KEY] = ctx
        token = LOG_CONTEXT.set({"request_id": ctx.request_id})
        status: int | None = None

        async def send_with_headers(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                out = MutableHeaders(scope=message)
                out["X-Request-Id"] = ctx.request_id
                out["Server-Timing"] = ctx.server_timing()
            await send(message)

        try:
            if self.auth.protects(path) and not self.auth.allows(headers):
                ctx.reason = "unauthorized"
                exc = RequestError("missing or invalid API key (Authorization: Bearer <key>)", status=401)
                await error_response(exc, ctx.dialect, {"WWW-Authenticate": "Bearer"})(scope, receive,
                                                                                        send_with_headers)
            else:
                await self.app(scope, receive, send_with_headers)
        except Exception as exc:  # noqa: BLE001 - nothing a client sends may produce a stack trace
            log.error("internal error on %s: %s", path, exc, exc_info=exc)
            ctx.reason = "internal"
            if status is None:
                await error_response(RequestError("internal server error", status=500), ctx.dialect)(
                    scope, receive, send_with_headers)
        finally:
            self._finish(scope, ctx, status)
            LOG_CONTEXT.reset(token)

    def _finish(self, scope: Scope, ctx: RequestContext, status: int | None) -> None:
        status = 500 if status is None else status
        if ctx.reason == "ok" and status >= 400:
            ctx.reason = reason_of(RequestError("", status=status))
        elapsed = ctx.elapsed()
        if ctx.route in PROBES:
            access_log.debug("%s %s %d", scope["method"], scope["path"], status)
            return
        self.metrics.observe_request(ctx.route, status, ctx.reason)
        if ctx.route in INTERACTIVE_ROUTES:
            self.metrics.stage_seconds.labels("total", "interactive").observe(elapsed)
        fields = {"method": scope["method"], "path": ctx.route, "status": status, "reason": ctx.reason,
                  "duration_ms": round(elapsed * 1000, 2)}
        if ctx.input_tokens is not None:
            fields["input_tokens"] = ctx.input_tokens
        if ctx.questions is not None:
            fields["questions"] = ctx.questions
        access_log.info("request", extra=fields)
