"""Workers AI's REST route, so that a client of Cloudflare's hosted model moves to this server by
changing its base URL and its token, nothing else::

    POST /client/v4/accounts/{account_id}/ai/run/{model_name}   the hosted API's full path
    POST /accounts/{account_id}/ai/run/{model_name}             the same under a base URL ending in /client/v4

Both answer exactly like ``POST /v1/systemone`` in the ``workers-ai`` dialect (hosted limits,
Gini-purity confidence, ``{result, success, errors, messages}`` envelope, Cloudflare's error
codes), whatever ``--dialect`` says for the native route: the route runs the native handler
itself, and the HTTP middleware gives every request under these two prefixes the ``workers-ai``
dialect (:func:`hosted_path`), so its errors (401, 404, 413, ...) carry the hosted envelope too.

* ``account_id``: any. This server has one tenant; the API key (``--api-key``, sent as
  ``Authorization: Bearer``) is the access control, as the API token is on the hosted service.
* ``model_name``: one of ``--served-model-name`` (a percent-encoded ``/`` is the same as ``/``,
  as clients that quote path segments send it). Another name is refused with 400 and the hosted
  "no route" code 7000, as the hosted API answers a model it does not have.
* Body: the SystemOne request. ``model`` may be left out, as the hosted model allows; the answer
  then echoes the model name's last segment (``clef-flash`` for ``@cf/cloudflare/clef-flash``),
  the name the hosted service echoes.
* No bulk variant: ``?queueRequest=true`` (the hosted asynchronous batch API) is refused with 400
  instead of being answered as if it were queued; many requests in one call go through
  ``POST /v1/systemone/bulk``. Hosted-route requests are interactive requests: same engine slots,
  queue, ``--request-timeout``, cancellation on disconnect, ``Server-Timing`` and request id.
* Metrics: one ``route`` label, :data:`HOSTED_ROUTE`, for both spellings and every account.
"""

from __future__ import annotations

import re
from typing import Awaitable, Callable, Iterable

from fastapi import FastAPI, Request
from starlette.responses import Response

from clef_vllm.schema.errors import Kind, RequestError
from clef_vllm.schema.protocol import Dialect
from clef_vllm.server.context import CONTEXT_KEY

#: Path prefixes answered in the hosted dialect (errors included), and protected by the API key.
HOSTED_PREFIXES = ("/client/v4", "/accounts")
#: The ``route`` label of ``clef_requests_total`` for both spellings and every account id.
HOSTED_ROUTE = "/accounts/{account_id}/ai/run/{model_name}"
HOSTED_DIALECT = Dialect.WORKERS_AI
_RUN_PATH = re.compile(r"(?:/client/v4)?/accounts/[^/]+/ai/run/.+", re.DOTALL)
_QUEUE_OFF = ("", "0", "false")


def hosted_path(path: str) -> bool:
    """Whether ``path`` is under the hosted API's prefixes (answered in the hosted dialect)."""
    return any(path == prefix or path.startswith(prefix + "/") for prefix in HOSTED_PREFIXES)


def hosted_route_label(path: str) -> str | None:
    """:data:`HOSTED_ROUTE` for a path of the hosted run route (either spelling), else ``None``."""
    return HOSTED_ROUTE if _RUN_PATH.fullmatch(path) else None


def echoed_model(model_name: str) -> str:
    """The ``model`` a body without one is answered with: the model name's last path segment."""
    return model_name.rstrip("/").rsplit("/", 1)[-1] or model_name


def unknown_model(model_name: str, served: Iterable[str]) -> RequestError:
    """:data:`~clef_vllm.schema.errors.Kind.UNKNOWN_MODEL` (400, hosted "no route" code 7000), naming the
    model asked for and the names served."""
    shown = model_name if len(model_name) <= 200 else model_name[:200] + "..."
    return RequestError(f"no route for model {shown!r}: this server runs {', '.join(map(repr, served))} "
                        "(--served-model-name)", kind=Kind.UNKNOWN_MODEL)


def install_hosted_routes(app: FastAPI, served_models: Iterable[str],
                          native: Callable[[Request], Awaitable[Response]]) -> None:
    """Add both spellings of the hosted route to ``app``; ``native`` is the ``POST /v1/systemone``
    handler, which answers them once the model name is checked."""
    served = tuple(served_models)

    async def run(request: Request, account_id: str, model_name: str) -> Response:
        ctx = request.scope["state"][CONTEXT_KEY]
        if model_name not in served:
            raise unknown_model(model_name, served)
        if request.query_params.get("queueRequest", "").strip().lower() not in _QUEUE_OFF:
            raise RequestError("queueRequest (the hosted asynchronous batch API) is not supported: this server answers "
                               "each request synchronously; send many requests as NDJSON to POST /v1/systemone/bulk",
                               kind=Kind.UNSUPPORTED)
        ctx.default_model = echoed_model(model_name)
        return await native(request)

    error = {"description": 'Hosted error envelope: {"success": false, "errors": [{"code", "message"}], '
                            '"messages": [], "result": null}'}
    responses = {200: {"description": 'Hosted success envelope: {"result": SystemOneResponse, "success": true, '
                                      '"errors": [], "messages": []}'},
                 400: error, 401: error, 413: error, 422: error, 429: error, 503: error, 504: error}
    body = {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/SystemOneRequest"}}}}}
    for prefix in ("/client/v4", ""):
        app.add_api_route(prefix + "/accounts/{account_id}/ai/run/{model_name:path}", run, methods=["POST"],
                          name=f"hosted_run{prefix.replace('/', '_')}", response_model=None, responses=responses,
                          openapi_extra=body, tags=["hosted (Workers AI)"],
                          summary="Workers AI's REST route: answers like POST /v1/systemone in the workers-ai "
                                  "dialect (`model` optional)")
