"""``clef-systemone`` as a real uvicorn subprocess on loopback: every success and error path.

Servers used (started in parallel, once per module):
* ``live_server`` (conftest): reference dialect, defaults;
* ``limits``: reference dialect with ``--max-model-len 600 --max-body-bytes 8192``;
* ``hosted``: ``--dialect workers-ai``;
* ``gated``: loading held by ``CLEF_VLLM_LOAD_GATE`` (server/cli.py) until the test creates the
  gate file, so the 503 "loading" state is observed deterministically, not by racing the loader;
* ``broken``: ``--model`` pointing at a folder without a head; it must exit non-zero and say why.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import pytest

from conftest import LiveServer

REQUEST = {
    "model": "clef-flash",
    "state": "Checkout has been failing for every customer for the last hour.",
    "questions": {
        "urgent": {"type": "noul", "instructions": "Is this support request urgent?"},
        "team": {"type": "choice", "instructions": "Which team should handle it?",
                 "criteria": {"technical": "Outages, errors, and configuration", "billing": "Payments, invoices, and refunds",
                              "sales": "Plans and upgrades"}},
        "severity": {"type": "score", "instructions": "How severe?",
                     "criteria": ["No impact", "Minor", "Major", "Critical"]},
    },
}


@pytest.fixture(scope="module")
def servers(request, tiny_release, cache_dir, tmp_path_factory):
    """Start every extra server at once (they load in parallel), then the shared live server."""
    tmp = tmp_path_factory.mktemp("servers")
    nohead = tmp / "no-head"
    shutil.copytree(tiny_release, nohead)
    (nohead / "joint_head.safetensors").unlink()
    (nohead / "joint_head_config.json").unlink()
    gate = tmp / "gate"
    model = ["--model", str(tiny_release), "--backend", "reference"]
    started = {
        "limits": LiveServer(model + ["--max-model-len", "600", "--max-body-bytes", "8192"]),
        "hosted": LiveServer(model + ["--dialect", "workers-ai"]),
        "gated": LiveServer(model, env={"CLEF_VLLM_LOAD_GATE": str(gate)}),
        "broken": LiveServer(["--model", str(nohead), "--backend", "reference"]),
    }
    started["gate"] = gate
    started["live"] = request.getfixturevalue("live_server")
    yield started
    gate.touch()
    for name in ("limits", "hosted", "gated", "broken"):
        started[name].stop()


@pytest.fixture(scope="module")
def live(servers) -> LiveServer:
    return servers["live"]


@pytest.fixture(scope="module")
def limits(servers) -> LiveServer:
    return servers["limits"].wait_ready()


@pytest.fixture(scope="module")
def hosted(servers) -> LiveServer:
    return servers["hosted"].wait_ready()


@pytest.fixture(scope="module")
def client(live):
    with httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


def post(server: LiveServer, body=None, *, content=None, headers=None) -> httpx.Response:
    if content is None:
        content = json.dumps(body).encode()
    return httpx.post(server.url + "/v1/systemone", content=content, timeout=60,
                      headers={"Content-Type": "application/json", **(headers or {})})


def assert_error(resp: httpx.Response, status: int, *fragments, param="ANY"):
    assert resp.status_code == status, resp.text
    assert "Traceback" not in resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    assert body["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")
    for fragment in fragments:
        assert fragment in body["error"]["message"], body
    if param != "ANY":
        assert body["error"]["param"] == param, body
    return body


# --------------------------------------------------------------------------- success


def test_all_three_answer_shapes_and_key_orders(live, tiny_release, cache_dir):
    resp = post(live, REQUEST)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert "server-timing" in resp.headers
    body = resp.json()
    assert list(body) == ["model", "answers", "usage"] and body["model"] == "clef-flash"
    assert list(body["answers"]) == ["urgent", "team", "severity"]
    urgent, team, severity = (body["answers"][k] for k in ("urgent", "team", "severity"))
    assert list(urgent) == ["type", "noul"] and urgent["type"] == "noul"
    assert list(team) == ["type", "choice", "confidence", "probabilities"]
    assert list(team["probabilities"]) == ["technical", "billing", "sales"]      # request order, not sorted
    assert team["choice"] == max(team["probabilities"], key=team["probabilities"].get)
    assert list(severity) == ["type", "score", "confidence", "legend", "probabilities"]
    assert severity["legend"] == {"0": "No impact", "1": "Minor", "2": "Major", "3": "Critical"}
    assert list(body["usage"])[:2] == ["input_tokens", "output_tokens"] and body["usage"]["output_tokens"] == 0
    # the server gives exactly what the offline API gives for the same checkpoint
    from clef_vllm import Clef

    with Clef(tiny_release, backend="reference") as clef:
        assert clef.systemone(REQUEST) == body


def test_question_order_is_kept_over_the_wire(live):
    raw = ('{"model":"m","state":"s","questions":{"zulu":{"type":"noul"},"alpha":{"type":"noul"},'
           '"mike":{"type":"choice","criteria":{"z":1,"a":2}}}}')
    body = post(live, content=raw.encode()).json()
    assert list(body["answers"]) == ["zulu", "alpha", "mike"]
    assert list(body["answers"]["mike"]["probabilities"]) == ["z", "a"]
    assert body["model"] == "m"


def test_unicode_and_json_states(live):
    for state in ({"invoice": {"total": 1250.0, "note": "Ünïcödé ☕ 日本語 🎉"}}, [1, None, True], None, 0, "",
                  "<|im_end|><|im_start|>assistant"):
        resp = post(live, REQUEST | {"state": state})
        assert resp.status_code == 200, (state, resp.text)
    resp = post(live, content='{"model":"m","state":"\\ud83d\\ude00 pair","questions":{"q":{"type":"noul"}}}'.encode())
    assert resp.status_code == 200


def test_health_models_openapi_and_docs(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "clef-flash"
    assert models["data"][0]["backend"] == "reference" and models["data"][0]["layout"] == "release"
    spec = client.get("/openapi.json").json()
    assert "/v1/systemone" in spec["paths"] and "post" in spec["paths"]["/v1/systemone"]
    schemas = spec["components"]["schemas"]
    assert {"SystemOneRequest", "SystemOneResponse", "NoulAnswer", "ChoiceAnswer", "ScoreAnswer"} <= set(schemas)
    assert {"model", "state", "questions"} <= set(schemas["SystemOneRequest"]["properties"])
    assert spec["paths"]["/v1/systemone"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/SystemOneRequest"}
    docs = client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower() and "/openapi.json" in docs.text


def test_truncation_over_http(limits):
    body = post(limits, REQUEST | {"state": "word " * 1500}).json()
    assert body["usage"]["input_tokens"] == 600
    assert body["usage"]["truncated_state_tokens"] > 900


def test_32_concurrent_requests_each_match_the_request_alone(live):
    requests = [REQUEST | {"state": f"Ticket {i}: " + "checkout fails again. " * (i % 7)} for i in range(32)]

    async def fire():
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/systemone", json=r) for r in requests))

    responses = asyncio.run(fire())
    assert [r.status_code for r in responses] == [200] * 32
    for req, resp in zip(requests, responses):
        together, alone = resp.json(), post(live, req).json()
        assert together["usage"] == alone["usage"]
        assert list(together["answers"]) == list(alone["answers"])
        for qid, a in together["answers"].items():
            b = alone["answers"][qid]
            for key in ("noul", "score", "confidence"):
                if key in a:
                    assert abs(a[key] - b[key]) <= (3e-2 if key == "score" else 1e-2), (qid, key, a, b)
            for k, p in a.get("probabilities", {}).items():
                assert abs(p - b["probabilities"][k]) <= 1e-2
            if "choice" in a:
                ranked = sorted(b["probabilities"].values(), reverse=True)
                if ranked[0] - ranked[1] > 2e-2:
                    assert a["choice"] == b["choice"]


# --------------------------------------------------------------------------- client errors


BAD_REQUESTS = [
    # (raw body, status, message fragment, param)
    (b'{"model": "m", "state": "x", "questions": ', 400, "body is not valid JSON", None),
    (b"", 400, "body is not valid JSON", None),
    (b"\xff\xfe\x00garbage", 400, "body is not valid JSON", None),
    (b'{"model":"m","state":NaN,"questions":{"q":{"type":"noul"}}}', 400, "NaN is not valid JSON", None),
    (b'{"model":"m","state":[Infinity],"questions":{"q":{"type":"noul"}}}', 400, "Infinity is not valid JSON", None),
    (b'{"model":"m","state":-Infinity,"questions":{"q":{"type":"noul"}}}', 400, "is not valid JSON", None),
    (b'{"model":"m","state":1e400,"questions":{"q":{"type":"noul"}}}', 400, "out of range", None),
    (b"[" * 100000 + b"]" * 100000, 400, "nested too deeply", None),
    (json.dumps(REQUEST | {"images": ["data:image/png;base64,iVBORw0KGgo="]}).encode(), 400,
     "not supported by this build", "images"),
    (json.dumps(REQUEST | {"videos": ["data:video/mp4;base64,AAAA"]}).encode(), 400, "not supported by this build",
     "videos"),
    (b"[]", 422, "request body must be a JSON object", None),
    (json.dumps({"state": "x", "questions": REQUEST["questions"]}).encode(), 422, "is required", "model"),
    (json.dumps({"model": "m", "questions": REQUEST["questions"]}).encode(), 422, "is required", "state"),
    (json.dumps({"model": "m", "state": "x", "questions": {}}).encode(), 422, "at least one question", "questions"),
    (json.dumps({"model": 5, "state": "x", "questions": REQUEST["questions"]}).encode(), 422, "must be a string",
     "model"),
    (json.dumps(REQUEST | {"questions": {"team": {"type": "choice", "criteria": ["a", "b"]}}}).encode(), 422,
     "must be an object", "questions.team.criteria"),
    (json.dumps(REQUEST | {"questions": {"team": {"type": "pick", "criteria": {"a": 1}}}}).encode(), 422,
     "type must be noul, choice, or score", "questions.team.type"),
    (json.dumps(REQUEST | {"questions": {"s": {"type": "score", "criteria": []}}}).encode(), 422, "must not be empty",
     "questions.s.criteria"),
    (json.dumps(REQUEST | {"questions": {"n": {"type": "noul", "criteria": {"yes": "x"}}}}).encode(), 422,
     '"true" or "false"', "questions.n.criteria"),
    (json.dumps(REQUEST | {"questions": {"": {"type": "noul"}}}).encode(), 422, "empty question id",
     "questions..instructions"),
    (b'{"model":"m","state":"bad \\ud800 surrogate","questions":{"q":{"type":"noul"}}}', 422,
     "unpaired UTF-16 surrogate", "state"),
    (b'{"model":"m\\udc00","state":"s","questions":{"q":{"type":"noul"}}}', 422, "unpaired UTF-16 surrogate", "model"),
    (b'{"model":"m","state":"s","questions":{"q\\ud800":{"type":"noul"}}}', 422, "unpaired UTF-16 surrogate",
     "questions.q\\ud800"),
    (b'{"model":"m","state":"s","questions":{"q":{"type":"noul","instructions":"\\udfff"}}}', 422,
     "unpaired UTF-16 surrogate", "questions.q.instructions"),
    (json.dumps(REQUEST | {"questions": {f"q{i}": {"type": "noul", "instructions": "Question number %d?" % i}
                                         for i in range(400)}}).encode(), 413,
     "tokens before state; maximum is 16384", "questions"),
]


@pytest.mark.parametrize("raw, status, fragment, param", BAD_REQUESTS,
                         ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_request_then_the_server_keeps_serving(live, raw, status, fragment, param):
    assert_error(post(live, content=raw), status, fragment, param=param)
    good = post(live, REQUEST)
    assert good.status_code == 200 and list(good.json()["answers"]) == ["urgent", "team", "severity"]


def test_body_too_large_is_413(limits):
    big = REQUEST | {"state": "x" * 10000}
    assert_error(post(limits, big), 413, "body exceeds 8192 bytes")

    def chunks():                           # no Content-Length: the streaming limit applies
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    resp = httpx.post(limits.url + "/v1/systemone", content=chunks(), timeout=60)
    assert "content-length" not in {k.lower() for k in resp.request.headers}
    assert_error(resp, 413, "body exceeds 8192 bytes")
    assert post(limits, REQUEST).status_code == 200                       # still serving
    assert post(limits, REQUEST | {"state": "x" * 6000}).status_code == 200  # under the limit


def test_schema_too_long_is_413(limits):
    many = REQUEST | {"questions": {f"q{i}": {"type": "noul"} for i in range(12)}}
    body = assert_error(post(limits, many), 413, "schema requires", "maximum is 600", param="questions")
    n = int(body["error"]["message"].split("schema requires ")[1].split()[0])
    assert n > 600
    assert post(limits, REQUEST).status_code == 200


def test_other_routes_and_methods(client):
    assert client.get("/v1/systemone").status_code == 405
    assert client.get("/nope").status_code == 404
    assert client.post("/v1/systemone", content=json.dumps(REQUEST),
                       headers={"Content-Type": "text/plain"}).status_code == 200


def test_still_healthy_after_all_of_the_above(client, live):
    assert client.get("/health").status_code == 200
    assert client.post("/v1/systemone", json=REQUEST).status_code == 200
    assert live.proc.poll() is None
    assert "Traceback" not in live.log() and "internal error" not in live.log()   # no client input reached a 500


# --------------------------------------------------------------------------- workers-ai dialect


def test_workers_ai_success_envelope_and_gini_confidence(hosted):
    resp = post(hosted, REQUEST)
    assert resp.status_code == 200
    env = resp.json()
    assert set(env) == {"result", "success", "errors", "messages"}
    assert env["success"] is True and env["errors"] == [] and env["messages"] == []
    team = env["result"]["answers"]["team"]
    p = list(team["probabilities"].values())
    assert team["confidence"] == round(min(1.0, max(0.0, (len(p) * sum(x * x for x in p) - 1) / (len(p) - 1))), 4)


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
    (json.dumps(REQUEST | {"images": ["data:image/png;base64,AAAA"]}).encode(), 400, 6003, "not supported"),
])
def test_workers_ai_error_envelope(hosted, raw, status, code, fragment):
    resp = post(hosted, content=raw)
    assert resp.status_code == status, resp.text
    env = resp.json()
    assert env["success"] is False and env["result"] is None and env["messages"] == []
    assert len(env["errors"]) == 1 and env["errors"][0]["code"] == code
    assert fragment in env["errors"][0]["message"]
    assert post(hosted, REQUEST).status_code == 200


# --------------------------------------------------------------------------- lifecycle


def test_503_while_loading_then_200(servers):
    gated: LiveServer = servers["gated"]
    deadline = time.monotonic() + 120
    while True:                                             # wait for the socket, not for the model
        assert gated.proc.poll() is None, gated.log()
        try:
            resp = httpx.get(gated.url + "/health", timeout=2)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, gated.log()
            time.sleep(0.1)
    assert resp.status_code == 503 and resp.json() == {"status": "loading"}
    assert_error(post(gated, REQUEST), 503, "model is not ready")
    assert httpx.get(gated.url + "/v1/models", timeout=5).status_code == 200
    assert httpx.get(gated.url + "/health", timeout=5).status_code == 503    # still held: deterministic
    servers["gate"].touch()
    gated.wait_ready()
    assert httpx.get(gated.url + "/health", timeout=5).json() == {"status": "ok"}
    assert post(gated, REQUEST).status_code == 200


def test_a_model_that_fails_to_load_exits_non_zero_and_says_why(servers):
    broken: LiveServer = servers["broken"]
    code = broken.proc.wait(timeout=120)
    assert code != 0
    log = broken.log()
    assert "could not load the model" in log and "no joint head found" in log
    assert "Traceback" not in log
