"""OpenAI's Decisions route, so that the ``openai`` SDK (``client.decisions.create``) and LangChain's
``OpenAIDecisions`` talk to this server unchanged (``base_url="http://HOST:8000/v1"``)::

    POST /v1/decisions        one Decisions request, answered with a Decisions response
    POST /v1/decisions/bulk   NDJSON: one Decisions request per line, one line per answer

The mapping lives in :mod:`clef_vllm.schema.openai_decisions` (the offline API's ``Clef.decisions`` uses
it too); here are only the routes. Both run the native handlers (same engine slots, queue,
``--request-timeout``, cancellation, ``Server-Timing``, ``X-Request-Id``, Bearer key) in the
``openai`` dialect, which the HTTP middleware gives every request under :data:`DECISIONS_PREFIX`
(:func:`decisions_path`), so their errors, 401 included, are OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (statuses and codes: ``server/errors.py``).
"""

from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from starlette.responses import Response

from clef_vllm.schema.protocol import Dialect

DECISIONS_PREFIX = "/v1/decisions"
DECISIONS_ROUTES = (DECISIONS_PREFIX, DECISIONS_PREFIX + "/bulk")
DECISIONS_DIALECT = Dialect.OPENAI


def decisions_path(path: str) -> bool:
    """Whether ``path`` is under :data:`DECISIONS_PREFIX` (answered in OpenAI's format, errors included)."""
    return path == DECISIONS_PREFIX or path.startswith(DECISIONS_PREFIX + "/")


def install_decisions_routes(app: FastAPI, native: Callable[[Request], Awaitable[Response]],
                             native_bulk: Callable[[Request], Awaitable[Response]]) -> None:
    """Add ``POST /v1/decisions`` and ``POST /v1/decisions/bulk``; ``native`` and ``native_bulk`` are the
    ``/v1/systemone`` handlers, which answer in the request's dialect."""
    error = {"description": 'OpenAI error body: {"error": {"message", "type", "param", "code"}}'}
    responses = {200: {"description": "A Decisions response: {model, answers: [...], usage}"},
                 400: error, 401: error, 408: error, 413: error, 415: error, 429: error, 503: error, 504: error}
    app.add_api_route(DECISIONS_PREFIX, native, methods=["POST"], name="decisions", response_model=None,
                      responses=responses, tags=["OpenAI Decisions"],
                      openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                          "schema": {"type": "object", "description": "OpenAI's DecisionCreateParams: model, input, "
                                     "questions (predicate / choice / score), optional name per question"}}}}},
                      summary="OpenAI's Decisions API (client.decisions.create): every question in one forward pass")
    app.add_api_route(DECISIONS_PREFIX + "/bulk", native_bulk, methods=["POST"], name="decisions_bulk",
                      response_model=None, tags=["OpenAI Decisions"],
                      openapi_extra={"requestBody": {"required": True, "content": {"application/x-ndjson": {
                          "schema": {"type": "string", "description": "One Decisions request JSON object per line"}}}}},
                      summary='Stream many Decisions requests: NDJSON in, {"index", "status", "body"} per line out')
