"""The hosted endpoint's REST route (``POST [/client/v4]/accounts/{account_id}/ai/run/{model_name}``)
on a real uvicorn server, called with Cloudflare's own Python SDK (``cloudflare`` 5.x, unmodified)
and with raw HTTP.

How the SDK is called: ``client.ai.run(model_name, account_id=..., extra_body=request)``, the
SDK's own call path for Workers AI models. Its typed keyword arguments cover the catalogue's
other tasks (``text``, ``prompt``, ``messages``, ...) and none of SystemOne's fields, but one of
its accepted argument sets is ``account_id`` alone, and ``extra_body`` ("additional JSON
properties") carries the SystemOne request as the body; the answer is the envelope's ``result``,
unwrapped by the SDK. So no generic request method is needed.

Also: the SDK configured only by its environment variables (``CLOUDFLARE_BASE_URL``,
``CLOUDFLARE_API_TOKEN``) and its async client; the workers-ai dialect's envelopes on the native route
(``POST /v1/systemone``); and the server's ``--gc-freeze off``.

Servers:
* ``hosted_server`` (this module): ``--dialect workers-ai``, an API key, two served names
  (``@cf/cloudflare/clef-flash``, ``clef-flash-hybrid``), a 64 KiB body cap, ``--gc-freeze off``;
* ``live_server`` (conftest): ``--dialect reference``, no key, default names: its hosted route
  must still answer in the workers-ai dialect, exactly as ``hosted_server``'s native route does.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
import hypothesis
import pytest
from hypothesis import strategies as st

from conftest import REQUEST, LiveServer
from support.server_calls import metrics_of, post

TOKEN = "cf-style-token-0123456789"
ACCOUNT = "023e105f4ecef8ad9ca31a8372d0c353"
MODEL = "@cf/cloudflare/clef-flash"
HYBRID = "clef-flash-hybrid"

WITHOUT_MODEL = {k: v for k, v in REQUEST.items() if k != "model"}
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PNG_1X1 = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


@pytest.fixture(scope="module")
def hosted_server(tiny_release, cache_dir):
    server = LiveServer(["--model", str(tiny_release), "--backend", "reference", "--dialect", "workers-ai",
                         "--api-key", TOKEN, "--served-model-name", MODEL, "--served-model-name", HYBRID,
                         "--max-body-bytes", "65536", "--gc-freeze", "off"]).wait_ready()
    yield server
    server.stop_clean()


@pytest.fixture(scope="module")
def sdk(hosted_server):
    from cloudflare import Cloudflare

    with Cloudflare(api_token=TOKEN, base_url=hosted_server.url + "/client/v4") as client:
        yield client


def native(server: LiveServer, body, headers=None) -> httpx.Response:
    return httpx.post(server.url + "/v1/systemone", json=body, headers=headers, timeout=60)


def run(server: LiveServer, path: str, body=None, *, content=None, headers=None) -> httpx.Response:
    content = json.dumps(body).encode() if content is None else content
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json", **(headers or {})})


def assert_hosted_error(resp: httpx.Response, status: int, code: int, *fragments: str) -> str:
    """The hosted error envelope, exactly: one error with Cloudflare's code; returns its message."""
    assert resp.status_code == status, resp.text
    env = resp.json()
    assert env == {"success": False, "errors": [{"code": code, "message": env["errors"][0]["message"]}],
                   "messages": [], "result": None}, env
    message = env["errors"][0]["message"]
    for fragment in fragments:
        assert fragment in message, env
    assert "Traceback" not in resp.text
    assert "x-request-id" in resp.headers and "server-timing" in resp.headers
    return message


# --------------------------------------------------------------------------- the official SDK


def test_sdk_decision_equals_the_native_route_in_the_workers_ai_dialect(sdk, hosted_server):
    expected = native(hosted_server, REQUEST, AUTH)
    assert expected.status_code == 200 and expected.json()["success"] is True
    result = sdk.ai.run(MODEL, account_id=ACCOUNT, extra_body=REQUEST)
    assert result == expected.json()["result"]
    assert list(result["answers"]) == ["urgent", "team", "severity"]
    assert list(result["answers"]["team"]["probabilities"]) == ["technical", "billing", "sales"]
    # the SDK's raw response: the whole envelope and this server's headers
    raw = sdk.ai.with_raw_response.run(MODEL, account_id=ACCOUNT, extra_body=REQUEST,
                                       extra_headers={"X-Request-Id": "sdk-call-1"})
    assert raw.status_code == 200 and json.loads(raw.text()) == expected.json()
    assert raw.headers["x-request-id"] == "sdk-call-1"
    assert "engine;dur=" in raw.headers["server-timing"] and "total;dur=" in raw.headers["server-timing"]


def test_sdk_body_without_model_and_a_second_served_name(sdk, hosted_server):
    expected = native(hosted_server, REQUEST, AUTH).json()["result"]
    assert sdk.ai.run(MODEL, account_id=ACCOUNT, extra_body=WITHOUT_MODEL) == expected     # echoes "clef-flash"
    other = sdk.ai.run(HYBRID, account_id="another-account", extra_body=WITHOUT_MODEL)
    assert other == {**expected, "model": HYBRID}


def test_sdk_configured_from_the_environment_and_the_async_client(hosted_server, monkeypatch):
    """A program that reads the SDK's own environment variables moves here without a code change."""
    import asyncio

    from cloudflare import AsyncCloudflare, Cloudflare

    expected = native(hosted_server, REQUEST, AUTH).json()["result"]
    for name in ("CLOUDFLARE_API_KEY", "CLOUDFLARE_EMAIL", "CLOUDFLARE_API_USER_SERVICE_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDFLARE_BASE_URL", hosted_server.url + "/client/v4")
    monkeypatch.setenv("CLOUDFLARE_API_TOKEN", TOKEN)
    with Cloudflare() as client:
        assert client.ai.run(MODEL, account_id=ACCOUNT, extra_body=REQUEST) == expected

    async def call():
        async with AsyncCloudflare() as client:
            return await client.ai.run(MODEL, account_id=ACCOUNT, extra_body=REQUEST)

    assert asyncio.run(call()) == expected


def test_sdk_wrong_token_raises_its_authentication_error(hosted_server):
    import cloudflare

    for token in ("wrong-token", TOKEN + "x"):
        with cloudflare.Cloudflare(api_token=token, base_url=hosted_server.url + "/client/v4") as client:
            with pytest.raises(cloudflare.AuthenticationError) as err:
                client.ai.run(MODEL, account_id=ACCOUNT, extra_body=REQUEST)
        assert err.value.status_code == 401
        assert err.value.body["errors"] == [{"code": 10000, "message": err.value.body["errors"][0]["message"]}]
        assert "missing or invalid API key" in str(err.value)


def test_sdk_invalid_requests_raise_its_bad_request_errors_with_our_message(sdk):
    import cloudflare

    too_many = WITHOUT_MODEL | {"questions": {f"q{i}": {"type": "noul", "instructions": "x"} for i in range(65)}}
    with pytest.raises(cloudflare.UnprocessableEntityError) as err:           # 422, hosted code 5012
        sdk.ai.run(MODEL, account_id=ACCOUNT, extra_body=too_many)
    assert err.value.body["errors"][0] == {"code": 5012, "message": "questions: at most 64 questions are allowed, "
                                                                    "got 65"}
    assert "at most 64 questions" in str(err.value)

    with pytest.raises(cloudflare.UnprocessableEntityError) as err:           # a 5th image: 422, 5012
        sdk.ai.run(MODEL, account_id=ACCOUNT, extra_body=REQUEST | {"images": [PNG_1X1] * 5})
    assert err.value.body["errors"][0] == {"code": 5012, "message": "images[4]: at most 4 images are allowed, got 5"}

    with pytest.raises(cloudflare.BadRequestError) as err:                    # unknown model: 400, "no route" 7000
        sdk.ai.run("@cf/cloudflare/clef", account_id=ACCOUNT, extra_body=REQUEST)
    assert err.value.body["errors"][0]["code"] == 7000
    assert "no route for model '@cf/cloudflare/clef'" in str(err.value) and repr(HYBRID) in str(err.value)


# --------------------------------------------------------------------------- raw HTTP (what curl sends)


SPELLINGS = [f"/client/v4/accounts/{ACCOUNT}/ai/run/{MODEL}", f"/accounts/{ACCOUNT}/ai/run/{MODEL}",
             f"/client/v4/accounts/{ACCOUNT}/ai/run/@cf%2Fcloudflare%2Fclef-flash"]


@pytest.mark.parametrize("path", SPELLINGS)
def test_raw_http_on_a_reference_dialect_server_answers_in_the_workers_ai_dialect(live_server, hosted_server, path):
    expected = native(hosted_server, REQUEST, AUTH).json()                   # workers-ai, from the other server
    resp = run(live_server, path, REQUEST, headers={"X-Request-Id": "curl-1"})
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert resp.json() == expected
    assert list(resp.json()) == ["result", "success", "errors", "messages"]
    assert resp.headers["x-request-id"] == "curl-1" and "engine;dur=" in resp.headers["server-timing"]
    assert run(live_server, path, WITHOUT_MODEL).json() == expected
    # `curl -d` without a Content-Type header (as the hosted API's own examples are written) sends the JSON as
    # application/x-www-form-urlencoded; the hosted API reads it as JSON, so does this route
    curl_d = run(live_server, path, REQUEST, headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert curl_d.status_code == 200 and curl_d.json() == expected
    bare = native(live_server, REQUEST).json()                               # the native route keeps its dialect
    assert set(bare) == {"model", "answers", "usage"}
    assert bare["answers"]["team"]["probabilities"] == expected["result"]["answers"]["team"]["probabilities"]


@pytest.mark.parametrize("prefix", ["/client/v4", ""])
def test_raw_http_errors_carry_the_hosted_envelope_on_both_spellings(live_server, hosted_server, prefix):
    path = f"{prefix}/accounts/{ACCOUNT}/ai/run/{MODEL}"
    for server in (live_server, hosted_server):                             # either --dialect
        headers = AUTH if server is hosted_server else {}
        assert_hosted_error(run(server, path, content=b"{oops", headers=headers), 400, 6003, "body is not valid JSON")
        assert_hosted_error(run(server, path, REQUEST | {"id": "x"}, headers=headers), 422, 5012, "id: unknown field")
        empty = WITHOUT_MODEL | {"questions": {"q": {"type": "noul", "instructions": ""}}}
        assert_hosted_error(run(server, path, empty, headers=headers), 422, 5012, "instructions are required")
        assert_hosted_error(run(server, f"{prefix}/accounts/{ACCOUNT}/ai/run/@cf/meta/llama-3-8b", REQUEST,
                                headers=headers), 400, 7000, "no route for model '@cf/meta/llama-3-8b'")
        assert_hosted_error(run(server, f"{prefix}/accounts/{ACCOUNT}/ai/models", REQUEST, headers=headers),
                            404, 7000, "no such route")
        assert_hosted_error(run(server, path + "?queueRequest=true", REQUEST, headers=headers), 400, 6003,
                            "queueRequest", "POST /v1/systemone/bulk")
        assert_hosted_error(httpx.get(server.url + path, headers=headers), 405, 7000, "method not allowed")
        # the hosted service's 13 MiB body cap, below --max-body-bytes (16 MiB by default), from Content-Length
        big = b'{"state": "' + b"x" * (13 * 2 ** 20) + b'"}'
        cap = "body exceeds 65536 bytes (--max-body-bytes)" if server is hosted_server else \
            "body exceeds 13631488 bytes (the hosted API's 13 MiB)"
        assert_hosted_error(run(server, path, content=big, headers=headers), 413, 5021, cap)
        # text/plain (what a cross-site form can forge JSON with) or no type at all: 415, as on /v1/systemone
        for content_type in ("text/plain", ""):
            assert_hosted_error(run(server, path, REQUEST, headers={**headers, "Content-Type": content_type}),
                                415, 6003, "Content-Type")
    # auth: the hosted route is behind --api-key, like /v1/*
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Token {TOKEN}"}):
        resp = run(hosted_server, path, REQUEST, headers=headers)
        assert_hosted_error(resp, 401, 10000, "missing or invalid API key")
        assert resp.headers["www-authenticate"] == "Bearer"
    assert_hosted_error(run(hosted_server, f"{prefix}/accounts/{ACCOUNT}/ai/run/nope", REQUEST), 401, 10000)
    assert_hosted_error(run(hosted_server, path, {"state": "x" * 70000, "questions": REQUEST["questions"]},
                            headers=AUTH), 413, 5021, "body exceeds 65536 bytes")
    # the default name is not served when --served-model-name names others
    assert_hosted_error(run(hosted_server, f"{prefix}/accounts/{ACCOUNT}/ai/run/clef-flash", REQUEST, headers=AUTH),
                        400, 7000, repr(MODEL), repr(HYBRID))
    assert run(hosted_server, path, REQUEST, headers=AUTH).status_code == 200


@hypothesis.settings(deadline=None, derandomize=True, database=None, max_examples=80,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(account=st.text(st.characters(exclude_categories=["Cs"]), max_size=30),
                  model=st.text(st.characters(exclude_categories=["Cs"]), max_size=60),
                  prefix=st.sampled_from(["/client/v4", ""]))
def test_any_account_and_model_segment_gets_a_hosted_answer_never_a_500(live_server, account, model, prefix):
    hypothesis.assume(account not in (".", "..") and model not in (".", ".."))    # clients resolve dot segments
    path = f"{prefix}/accounts/{quote(account, safe='')}/ai/run/{quote(model, safe='@')}"
    resp = httpx.post(live_server.url + path, json=REQUEST, timeout=60)
    assert resp.status_code < 500, resp.text
    env = resp.json()
    if resp.status_code == 200:
        assert model in ("clef-flash", MODEL) and env["success"] is True
    else:
        # an unknown model is 400, a path the route does not match (empty account, control characters) 404:
        # "no route" (7000) both times, in the hosted envelope
        assert resp.status_code in (400, 404) and env["success"] is False and env["result"] is None, (path, env)
        assert env["errors"][0]["code"] == 7000, (path, env)


def test_one_metrics_label_for_every_account_and_spelling(hosted_server):
    from prometheus_client.parser import text_string_to_metric_families

    def samples():
        text = httpx.get(hosted_server.url + "/metrics", timeout=30).text
        return [s for family in text_string_to_metric_families(text) for s in family.samples]

    def count(name, **labels):
        return sum(s.value for s in samples()
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    route = "/accounts/{account_id}/ai/run/{model_name}"
    ok_before = count("clef_requests_total", route=route, status="200")
    totals_before = count("clef_stage_seconds_count", stage="total", kind="interactive")
    small = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "x"}}}
    for account in ("acct-a", "acct-b"):
        for prefix in ("/client/v4", ""):
            assert run(hosted_server, f"{prefix}/accounts/{account}/ai/run/{MODEL}", small, headers=AUTH
                       ).status_code == 200
    assert run(hosted_server, f"/accounts/acct-d/ai/run/{MODEL}", REQUEST).status_code == 401
    assert count("clef_requests_total", route=route, status="200") - ok_before == 4
    assert count("clef_requests_total", route=route, status="401", reason="unauthorized") >= 1
    # every response of the route is timed, as on /v1/systemone (the 401 too)
    assert count("clef_stage_seconds_count", stage="total", kind="interactive") - totals_before == 5
    routes = {s.labels["route"] for s in samples() if s.name == "clef_requests_total"}
    assert routes <= {route, "/v1/systemone", "/v1/models", "other"}, routes
    assert not any("acct" in r or ACCOUNT in r for r in routes)


def test_models_lists_every_served_name_and_openapi_documents_the_route(hosted_server, live_server):
    ids = [m["id"] for m in httpx.get(hosted_server.url + "/v1/models", headers=AUTH, timeout=10).json()["data"]]
    assert ids == [MODEL, HYBRID]
    ids = [m["id"] for m in httpx.get(live_server.url + "/v1/models", timeout=10).json()["data"]]
    assert ids == ["clef-flash", MODEL]                                      # the defaults
    paths = httpx.get(live_server.url + "/openapi.json", timeout=10).json()["paths"]
    for path in ("/client/v4/accounts/{account_id}/ai/run/{model_name}", "/accounts/{account_id}/ai/run/{model_name}"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": "#/components/schemas/SystemOneRequest"}


def test_served_model_name_flag():
    from clef_vllm.server.cli import _served_models, build_parser
    from clef_vllm.server.settings import ServerSettings

    parse = build_parser().parse_args
    assert _served_models(parse([])) == ("clef-flash", MODEL)
    assert _served_models(parse(["--served-model-name", "a", "--served-model-name", "b/c"])) == ("a", "b/c")
    with pytest.raises(SystemExit):
        _served_models(parse(["--served-model-name", " "]))
    assert ServerSettings(served_models=("a", "a", "b")).served_models == ("a", "b")
    with pytest.raises(ValueError):
        ServerSettings(served_models=())


# --------------------------------------------------------------------------- the dialect on the native route


def test_workers_ai_success_envelope_and_gini_confidence(hosted_server):
    resp = post(hosted_server, REQUEST, headers=AUTH)
    assert resp.status_code == 200
    env = resp.json()
    assert set(env) == {"result", "success", "errors", "messages"}
    assert env["success"] is True and env["errors"] == [] and env["messages"] == []
    team = env["result"]["answers"]["team"]
    p = list(team["probabilities"].values())
    assert team["confidence"] == round(min(1.0, max(0.0, (len(p) * sum(x * x for x in p) - 1) / (len(p) - 1))), 4)


def test_gc_freeze_off_leaves_start_up_objects_in_the_collections(hosted_server):
    """``--gc-freeze off`` (``hosted_server`` runs with it): nothing frozen, no freeze logged, the full
    collections still timed on /metrics."""
    m = metrics_of(hosted_server)
    assert m[("clef_gc_frozen_objects", ())] == 0 and ("clef_gc_pause_seconds", ()) in m
    assert "objects from start-up frozen" not in hosted_server.log()


@pytest.mark.parametrize("raw, status, code, fragment", [
    (json.dumps(REQUEST | {"id": "x"}).encode(), 422, 5012, "id: unknown field"),
    (json.dumps(REQUEST | {"questions": {f"q{i}": {"type": "noul", "instructions": "x"} for i in range(65)}}).encode(),
     422, 5012, "at most 64 questions"),
    (json.dumps(REQUEST | {"questions": {"a b": {"type": "noul", "instructions": "x"}}}).encode(), 422, 5012,
     "question id must match"),
    (json.dumps(REQUEST | {"questions": {"q": {"type": "noul", "instructions": ""}}}).encode(), 422, 5012,
     "instructions are required"),
    (json.dumps(REQUEST | {"questions": {"q": {"type": "score", "instructions": "x", "criteria": list(range(11))}}}
                ).encode(), 422, 5012, "2-10 levels"),
    (b"{oops", 400, 6003, "body is not valid JSON"),
    (json.dumps(REQUEST | {"images": [PNG_1X1] * 5}).encode(), 422, 5012, "images[4]: at most 4 images"),
])
def test_workers_ai_error_envelope(hosted_server, raw, status, code, fragment):
    resp = post(hosted_server, content=raw, headers=AUTH)
    assert resp.status_code == status, resp.text
    env = resp.json()
    assert env["success"] is False and env["result"] is None and env["messages"] == []
    assert len(env["errors"]) == 1 and env["errors"][0]["code"] == code
    assert fragment in env["errors"][0]["message"]
    assert post(hosted_server, REQUEST, headers=AUTH).status_code == 200


def test_hosted_dialect_envelope_for_routing_errors(hosted_server):
    resp = httpx.get(hosted_server.url + "/nope")
    assert resp.status_code == 404 and resp.json()["errors"][0]["code"] == 7000
    assert "x-request-id" in resp.headers and "server-timing" in resp.headers
