"""Error kinds, independent of HTTP.

Everything that can go wrong with one request is a :class:`ClefError` carrying a :class:`Kind`.
The protocol, the encoder, the backends and the server's service raise them; the HTTP layer maps
each kind to a status code, a metrics ``reason`` and the hosted error code in ONE table
(``clef_vllm/server/errors.py``). The offline API raises them as they are: a request that is
wrong is a :class:`RequestError` (a ``ValueError``) whose ``field`` names the offending part.
"""

from __future__ import annotations

from enum import Enum


class Kind(str, Enum):
    """What went wrong. The value is stable (logs, tests); HTTP statuses live in the server."""

    # the request is wrong (RequestError)
    MALFORMED = "malformed"                      # not JSON / not NDJSON
    UNSUPPORTED = "unsupported"                  # a feature this build does not have (images, videos)
    INVALID = "invalid"                          # well-formed but not a valid request
    MEDIA_MALFORMED = "media_malformed"          # an images/videos entry that is no inline image (bad base64, a URL)
    MEDIA_INVALID = "media_invalid"              # bytes that are no accepted image (corrupt, wrong format); too many
    MEDIA_TOO_LARGE = "media_too_large"          # an image's or the request's bytes, pixels or frames over the limits
    BODY_TOO_LARGE = "body_too_large"            # more bytes than the body cap
    TOO_COMPLEX = "too_complex"                  # structural limits: JSON values, nesting, questions, options, chars
    SCHEMA_TOO_LONG = "schema_too_long"          # prompt + questions alone exceed the token limit
    TOO_MANY_TOKENS = "too_many_tokens"          # the state does not fit and cutting it is not allowed
    UNAUTHORIZED = "unauthorized"
    NOT_FOUND = "not_found"
    UNKNOWN_MODEL = "unknown_model"              # the hosted route names a model this server does not serve
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    SLOW_CLIENT = "slow_client"                  # headers or body not received in time
    # the client went away before the answer (ClientClosed)
    CLIENT_CLOSED = "client_closed"
    # the service cannot answer now (ServiceError)
    OVERLOADED = "overloaded"                    # engine slots and wait queue full
    BULK_STREAMS = "bulk_streams"                # too many bulk streams open
    CONNECTIONS = "connections"                  # too many open connections (only probes are served)
    NOT_READY = "not_ready"                      # still loading
    DRAINING = "draining"                        # shutting down
    LOAD_FAILED = "load_failed"                  # the model never loaded
    ENGINE_DEAD = "engine_dead"                  # the engine died while serving
    TIMEOUT = "timeout"                          # not answered within the request timeout
    ENGINE_ERROR = "engine_error"                # an engine call raised (not a dead engine)
    INTERNAL = "internal"                        # a bug


class ClefError(Exception):
    """A failure of one request. ``field`` is a path into the request (``questions.team.criteria``);
    ``retry_after`` (seconds) is set when trying again later can help."""

    default_kind = Kind.INTERNAL

    def __init__(self, message: str, *, kind: Kind | None = None, field: str | None = None,
                 retry_after: int | None = None):
        # Messages and field paths can quote client strings; escape lone surrogates so an error is
        # always encodable as UTF-8.
        message, field = printable(message), None if field is None else printable(field)
        super().__init__(f"{field}: {message}" if field else message)
        self.kind = Kind(kind or self.default_kind)
        self.message = message
        self.field = field
        self.retry_after = retry_after

    def with_field_prefix(self, prefix: str | None) -> "ClefError":
        """The same error with ``prefix`` in front of its field (``requests[3]`` in a batch)."""
        field = ".".join(p for p in (prefix, self.field) if p) or None
        return type(self)(self.message, kind=self.kind, field=field, retry_after=self.retry_after)


class RequestError(ClefError, ValueError):
    """The request itself is wrong: sending it again will fail again."""

    default_kind = Kind.INVALID


class ServiceError(ClefError):
    """The service could not answer (busy, not ready, shutting down, timed out, engine failure)."""


class ClientClosed(ClefError):
    """The client went away before its answer was ready."""

    default_kind = Kind.CLIENT_CLOSED


def printable(text: str) -> str:
    """``text`` with unpaired UTF-16 surrogates written as ``\\udXXX`` escapes (valid UTF-8)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
