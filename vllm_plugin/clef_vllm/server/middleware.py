"""The HTTP edge (pure ASGI, so streaming bodies pass untouched): request id, the request's
dialect (``workers-ai`` under the hosted route's prefixes, else ``--dialect``), bearer auth,
``Server-Timing`` and ``X-Request-Id`` headers, the access log line, request metrics, a
dialect-shaped error for anything that escapes the app (a 500 for a bug), 499 for a client that
left, ``Connection: close`` on an answer sent before the request body was read to its end, and on
the connections kept beyond ``--max-connections`` for the probes (anything else is refused there with 503)."""

from __future__ import annotations

import hmac
import logging

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clef_vllm.schema.errors import ClefError, ClientClosed, Kind, ServiceError
from clef_vllm.schema.protocol import Dialect
from clef_vllm.server.connection import PROBE_ONLY
from clef_vllm.server.context import CONTEXT_KEY, RequestContext, accept_request_id
from clef_vllm.server.decisions import DECISIONS_DIALECT, DECISIONS_PREFIX, DECISIONS_ROUTES, decisions_path
from clef_vllm.server.errors import OUTCOMES, error_response, outcome
from clef_vllm.server.hosted import HOSTED_DIALECT, HOSTED_ROUTE, hosted_path, hosted_route_label
from clef_vllm.util.logs import LOG_CONTEXT
from clef_vllm.server.metrics import ServerMetrics

log = logging.getLogger("clef_vllm.server")
access_log = logging.getLogger("clef_vllm.access")

#: Routes with their own metrics label; anything else is "other".
ROUTES = ("/v1/systemone", "/v1/systemone/bulk", *DECISIONS_ROUTES, "/v1/models", "/health", "/health/live", "/metrics",
          "/openapi.json", "/docs", "/redoc")
PROBES = ("/health", "/health/live", "/metrics")
#: The API documentation: open, or behind the key with the probes (``--auth-health-metrics``).
DOCS = ("/docs", "/redoc", "/openapi.json")
DOCS_ASSETS = "/docs/assets/"
#: Routes whose whole time is observed as ``clef_stage_seconds{stage="total", kind="interactive"}``.
INTERACTIVE_ROUTES = ("/v1/systemone", HOSTED_ROUTE, DECISIONS_PREFIX)
_STATUS_REASON = {o.status: o.reason for kind, o in reversed(OUTCOMES.items())}

class BearerAuth:
    """``Authorization: Bearer <key>`` against one or more keys, compared in constant time."""

    def __init__(self, keys: tuple[str, ...], protect_probes: bool):
        self.keys = tuple(k.encode("utf-8") for k in keys if k)
        self.protect_probes = protect_probes

    def protects(self, path: str) -> bool:
        """``/v1/*`` always (with a key); the probes, ``/metrics`` and the API documentation
        (``/docs``, ``/redoc``, ``/openapi.json`` and the pages' assets) with ``--auth-health-metrics``."""
        if not self.keys:
            return False
        return path.startswith("/v1/") or hosted_path(path) or (self.protect_probes and (
            path in PROBES or path in DOCS or path.startswith(DOCS_ASSETS)))

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
                             dialect=HOSTED_DIALECT if hosted_path(path) else
                             DECISIONS_DIALECT if decisions_path(path) else self.dialect)
        scope.setdefault("state", {})[CONTEXT_KEY] = ctx
        token = LOG_CONTEXT.set({"request_id": ctx.request_id})
        status: int | None = None
        body_done = scope["method"] in ("GET", "HEAD", "OPTIONS")
        probe_only = scope.get("extensions", {}).get(PROBE_ONLY, False)     # a connection past --max-connections

        async def receive_tracking() -> Message:
            nonlocal body_done
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                body_done = True
            return message

        async def send_with_headers(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                out = MutableHeaders(scope=message)
                out["X-Request-Id"] = ctx.request_id
                out["Server-Timing"] = ctx.server_timing()
                has_body = headers.get("content-length", "0") != "0" or "chunked" in headers.get("transfer-encoding", "")
                if (status >= 400 and has_body and not body_done) or probe_only:
                    out["Connection"] = "close"      # the rest of the body is not read, or a probes' connection
            await send(message)

        try:
            if probe_only and path not in PROBES:
                exc = ServiceError("too many open connections (--max-connections): only GET /health, /health/live "
                                   "and /metrics are served on this one", kind=Kind.CONNECTIONS)
                ctx.reason = outcome(exc).reason
                await error_response(exc, ctx.dialect)(scope, receive_tracking, send_with_headers)
            elif self.auth.protects(path) and not self.auth.allows(headers):
                exc = ClefError("missing or invalid API key (Authorization: Bearer <key>)", kind=Kind.UNAUTHORIZED)
                ctx.reason = outcome(exc).reason
                await error_response(exc, ctx.dialect)(scope, receive_tracking, send_with_headers)
            else:
                await self.app(scope, receive_tracking, send_with_headers)
        except ClientClosed:
            ctx.reason, status = outcome(ClientClosed("")).reason, 499
        except ClefError as exc:                    # raised where no exception handler runs
            ctx.reason = outcome(exc).reason
            if status is None:
                await error_response(exc, ctx.dialect)(scope, receive_tracking, send_with_headers)
        except Exception as exc:  # noqa: BLE001 - nothing a client sends may produce a stack trace
            log.error("internal error on %s: %s", path, exc, exc_info=exc)
            ctx.reason = "internal"
            if status is None:
                await error_response(ClefError("internal server error", kind=Kind.INTERNAL), ctx.dialect)(
                    scope, receive_tracking, send_with_headers)
        finally:
            self._finish(scope, ctx, status)
            LOG_CONTEXT.reset(token)

    def _finish(self, scope: Scope, ctx: RequestContext, status: int | None) -> None:
        if status is None:                          # nothing was sent: the client left, or the task was cancelled
            status = 499 if ctx.reason == "client_closed" else 500
            if status == 500 and ctx.reason == "ok":
                ctx.reason = "internal"
        if ctx.reason == "ok" and status >= 400:
            ctx.reason = _STATUS_REASON.get(status, "error")
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
