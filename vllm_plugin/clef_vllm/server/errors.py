"""The one place where error kinds become HTTP: status, metrics ``reason`` label, hosted error code.

Every error the server answers goes through :data:`OUTCOMES`; the code that raises an error only
names its :class:`~clef_vllm.schema.errors.Kind`. docs/operating.md lists the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from clef_vllm.schema.errors import ClefError, Kind, ServiceError
from clef_vllm.schema.protocol import Dialect


@dataclass(frozen=True)
class Outcome:
    status: int
    reason: str                  # the ``reason`` label of clef_requests_total / clef_bulk_records_total
    hosted_code: int             # the code in the Workers AI error envelope


#: kind -> (HTTP status, metrics reason, hosted error code).
OUTCOMES: dict[Kind, Outcome] = {
    Kind.MALFORMED: Outcome(400, "bad_request", 6003),
    Kind.UNSUPPORTED: Outcome(400, "unsupported", 6003),
    Kind.MEDIA_MALFORMED: Outcome(400, "media_malformed", 5006),
    Kind.UNKNOWN_MODEL: Outcome(400, "unknown_model", 7000),      # the hosted API's "no route"
    Kind.UNAUTHORIZED: Outcome(401, "unauthorized", 10000),
    Kind.NOT_FOUND: Outcome(404, "not_found", 7000),
    Kind.METHOD_NOT_ALLOWED: Outcome(405, "method_not_allowed", 7000),
    Kind.SLOW_CLIENT: Outcome(408, "slow_client", 6003),
    Kind.BODY_TOO_LARGE: Outcome(413, "body_too_large", 5021),
    Kind.TOO_COMPLEX: Outcome(413, "too_complex", 5021),
    Kind.SCHEMA_TOO_LONG: Outcome(413, "schema_too_long", 5021),
    Kind.TOO_MANY_TOKENS: Outcome(413, "too_many_tokens", 5021),
    Kind.MEDIA_TOO_LARGE: Outcome(413, "media_too_large", 5021),
    Kind.UNSUPPORTED_MEDIA_TYPE: Outcome(415, "unsupported_media_type", 6003),
    Kind.INVALID: Outcome(422, "invalid", 5012),
    Kind.MEDIA_INVALID: Outcome(422, "media_invalid", 5012),
    Kind.OVERLOADED: Outcome(429, "queue_full", 3040),
    Kind.BULK_STREAMS: Outcome(429, "bulk_streams", 3040),
    Kind.CLIENT_CLOSED: Outcome(499, "client_closed", 5012),
    Kind.INTERNAL: Outcome(500, "internal", 5012),
    Kind.ENGINE_ERROR: Outcome(500, "engine_error", 5012),
    Kind.CONNECTIONS: Outcome(503, "connections", 3040),
    Kind.NOT_READY: Outcome(503, "not_ready", 3040),
    Kind.DRAINING: Outcome(503, "draining", 3040),
    Kind.LOAD_FAILED: Outcome(503, "load_failed", 3040),
    Kind.ENGINE_DEAD: Outcome(503, "engine_failed", 3040),
    Kind.TIMEOUT: Outcome(504, "timeout", 5012),
}

_HTTP_KINDS = {404: Kind.NOT_FOUND, 405: Kind.METHOD_NOT_ALLOWED}

#: OpenAI's Decisions route (``Dialect.OPENAI``): the kinds whose status differs there (OpenAI answers a
#: request it cannot take with 400, a prompt that does not fit included), and each kind's ``code``.
OPENAI_STATUS = {Kind.INVALID: 400, Kind.TOO_COMPLEX: 400, Kind.SCHEMA_TOO_LONG: 400, Kind.TOO_MANY_TOKENS: 400,
                 Kind.MEDIA_INVALID: 400, Kind.MEDIA_TOO_LARGE: 400}
OPENAI_CODES = {Kind.MALFORMED: "invalid_json", Kind.UNSUPPORTED: "unsupported_value", Kind.INVALID: "invalid_value",
                Kind.TOO_COMPLEX: "request_too_large", Kind.SCHEMA_TOO_LONG: "context_length_exceeded",
                Kind.TOO_MANY_TOKENS: "context_length_exceeded", Kind.BODY_TOO_LARGE: "request_too_large",
                Kind.UNAUTHORIZED: "invalid_api_key", Kind.NOT_FOUND: "not_found",
                Kind.UNKNOWN_MODEL: "model_not_found", Kind.OVERLOADED: "rate_limit_exceeded",
                Kind.BULK_STREAMS: "rate_limit_exceeded", Kind.MEDIA_MALFORMED: "invalid_image",
                Kind.MEDIA_INVALID: "invalid_image", Kind.MEDIA_TOO_LARGE: "image_too_large"}


def outcome(exc: ClefError) -> Outcome:
    return OUTCOMES[exc.kind]


def error_status(exc: ClefError, dialect: Dialect | str = Dialect.REFERENCE) -> int:
    """The HTTP status of ``exc`` on a route of ``dialect``."""
    status = outcome(exc).status
    return OPENAI_STATUS.get(exc.kind, status) if Dialect(dialect) is Dialect.OPENAI else status


def from_http_exception(exc: StarletteHTTPException) -> ClefError:
    """Starlette's routing errors (404, 405) as our kinds."""
    kind = _HTTP_KINDS.get(exc.status_code)
    if kind is Kind.NOT_FOUND:
        return ClefError("no such route", kind=kind)
    if kind is Kind.METHOD_NOT_ALLOWED:
        return ClefError("method not allowed", kind=kind)
    return ServiceError(str(exc.detail), kind=Kind.INTERNAL)


def error_body(exc: ClefError, dialect: Dialect | str = Dialect.REFERENCE) -> dict:
    """The JSON error body in the dialect's envelope."""
    out = outcome(exc)
    if Dialect(dialect) is Dialect.WORKERS_AI:
        return {"success": False, "errors": [{"code": out.hosted_code, "message": str(exc)}], "messages": [],
                "result": None}
    kind = "invalid_request_error" if out.status < 500 else "server_error"
    if Dialect(dialect) is Dialect.OPENAI:     # OpenAI's envelope: a string code, the param as a JSON path
        return {"error": {"message": str(exc), "type": kind, "param": exc.field,
                          "code": OPENAI_CODES.get(exc.kind, exc.kind.value)}}
    return {"error": {"message": str(exc), "type": kind, "param": exc.field, "code": out.status}}


def error_headers(exc: ClefError) -> dict[str, str]:
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    if exc.kind is Kind.UNAUTHORIZED:
        headers["WWW-Authenticate"] = "Bearer"
    return headers


def error_response(exc: ClefError, dialect: Dialect | str = Dialect.REFERENCE,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The error as an HTTP response: status, dialect body, ``Retry-After`` / ``WWW-Authenticate``."""
    return JSONResponse(error_body(exc, dialect), status_code=error_status(exc, dialect),
                        headers={**error_headers(exc), **(headers or {})})
