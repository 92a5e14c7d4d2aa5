"""``clef-systemone`` over HTTP on the shared live server (reference dialect, defaults): the three answer
shapes, every client error and the routes, ``Server-Timing`` / request ids and the ``/metrics`` counts.

Nothing here asserts on durations: waits poll a state (``/metrics``, a log line) with a bound that only stops
a hang.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import httpx
import pytest

from conftest import REPO, REQUEST
from support.server_calls import assert_error, metric, metrics_of, post, server_timing, wait_until

#: A valid 1x1 PNG (tests/test_media*.py): served as an image; a video of it is refused (400).
PNG_1X1 = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="

ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def live(live_server):
    return live_server


@pytest.fixture(scope="module")
def client(live):
    with httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


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
    (json.dumps(REQUEST | {"videos": [[PNG_1X1, PNG_1X1]]}).encode(), 400, "videos are not served", "videos"),
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
     'questions[""].instructions'),
    (b'{"model":"m","state":' + b"1" * 5000 + b',"questions":{"q":{"type":"noul"}}}', 400,
     "an integer has 5000 digits; at most 4300 are allowed", None),
    (b'{"model":"m","state":"bad \\ud800 surrogate","questions":{"q":{"type":"noul"}}}', 422,
     "unpaired UTF-16 surrogate", "state"),
    (b'{"model":"m\\udc00","state":"s","questions":{"q":{"type":"noul"}}}', 422, "unpaired UTF-16 surrogate", "model"),
    (b'{"model":"m","state":"s","questions":{"q\\ud800":{"type":"noul"}}}', 422, "unpaired UTF-16 surrogate",
     'questions["q\\ud800"]'),
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



def test_other_routes_and_methods(client):
    assert client.get("/v1/systemone").status_code == 405
    assert client.get("/nope").status_code == 404
    assert client.get("/health/").status_code == 404                       # no trailing-slash redirects
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None,
                         "application/json; charset=latin-1", "application/x-ndjson"):
        resp = client.post("/v1/systemone", content=json.dumps(REQUEST),
                           headers={"Content-Type": content_type} if content_type else {})
        if content_type is None:
            assert "content-type" not in resp.request.headers
        assert_error(resp, 415, "Content-Type must be application/json" if "latin" not in str(content_type)
                     else "charset must be utf-8")
    for content_type in ("application/json", "Application/JSON; charset=UTF-8"):
        assert client.post("/v1/systemone", content=json.dumps(REQUEST),
                           headers={"Content-Type": content_type}).status_code == 200
    resp = client.post("/v1/systemone/bulk", content=json.dumps(REQUEST) + "\n", headers={"Content-Type": "text/plain"})
    assert_error(resp, 415, "application/x-ndjson or application/jsonl")
    for content_type in ("application/x-ndjson", "application/jsonl"):
        resp = client.post("/v1/systemone/bulk", content=json.dumps(REQUEST) + "\n", headers={"Content-Type": content_type})
        assert resp.status_code == 200 and resp.text.splitlines()[-1].startswith('{"summary":{"records":1,"ok":1')


def test_still_healthy_after_all_of_the_above(client, live):
    assert client.get("/health").status_code == 200
    assert client.post("/v1/systemone", json=REQUEST).status_code == 200
    assert live.proc.poll() is None
    assert "Traceback" not in live.log() and "internal error" not in live.log()   # no client input reached a 500


# --------------------------------------------------------------------------- metrics, timing, request ids


def test_server_timing_and_request_id_on_every_response(live):
    ok = post(live, REQUEST, headers={"X-Request-Id": "client-id.42:a"})
    assert ok.headers["x-request-id"] == "client-id.42:a"
    stages = server_timing(ok)
    # the reference backend tells backbone and head apart; every stage of a decision is there
    assert list(stages) == ["parse", "queue", "encode", "batch_wait", "backbone", "head", "engine", "total"]
    assert stages["total"] >= stages["engine"] >= stages["backbone"] and stages["head"] >= 0
    for resp in (post(live, {"model": "m"}), post(live, content=b"{"), httpx.get(live.url + "/health"),
                 httpx.get(live.url + "/nope"), httpx.get(live.url + "/metrics")):
        assert "total" in server_timing(resp) and re.fullmatch(r"[0-9a-f]{32}", resp.headers["x-request-id"])
    for insane in (b"has space", b"x" * 129, b"semi;colon", "\u00fcn\u00ef".encode()):
        rid = post(live, REQUEST, headers={"X-Request-Id": insane}).headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", rid)
    assert "access-control-allow-origin" not in post(live, REQUEST, headers={"Origin": ORIGIN}).headers  # CORS off


def test_metrics_count_requests_stages_tokens_batches_and_answers(live):
    before = metrics_of(live)
    # the server froze start-up's objects out of the garbage collector's full collections once loaded (each
    # walked ~570,000 objects for ~0.4 s on the event loop, bench/results/cpu_gc_full_collections_*.json)
    assert before[("clef_gc_frozen_objects", ())] > 50_000
    assert ("clef_gc_full_collections", ()) in before and before[("clef_gc_pause_seconds", ())] >= 0
    assert re.search(r"garbage collector: \d+ objects from start-up frozen", live.log())
    # the event loop's timers are watched from ready on (20 a second): a held loop reads and answers nothing
    wait_until(lambda: metric(live, "clef_event_loop_lag_seconds_count") > 0, "the loop watcher", 10)

    def delta(name, **labels):
        now = metric(live, name, **labels)
        then = sum(v for (n, ls), v in before.items()
                   if n == name and all(dict(ls).get(k) == str(w) for k, w in labels.items()))
        return now - then

    assert post(live, REQUEST).status_code == 200
    assert post(live, {"model": "m", "state": "s", "questions": {}}).status_code == 422
    assert post(live, content=b"nope").status_code == 400
    route = "/v1/systemone"
    assert delta("clef_requests_total", route=route, status=200, reason="ok") == 1
    assert delta("clef_requests_total", route=route, status=422, reason="invalid") == 1
    assert delta("clef_requests_total", route=route, status=400, reason="bad_request") == 1
    for stage in ("parse", "queue", "encode", "batch_wait", "backbone", "head", "engine"):
        assert delta("clef_stage_seconds_count", stage=stage, kind="interactive") == 1, stage
    assert delta("clef_stage_seconds_count", stage="total", kind="interactive") == 3       # errors are timed too
    assert delta("clef_input_tokens_count") == 1 and delta("clef_input_tokens_sum") > 100
    assert delta("clef_questions_per_request_sum") == 3
    assert delta("clef_batch_size_count") == 1 and delta("clef_batch_size_sum") == 1
    assert delta("clef_answers_total", type="noul") == 1 and delta("clef_answers_total", type="choice") == 1
    m = metrics_of(live)
    assert m[("clef_ready", ())] == 1 and m[("clef_in_flight", ())] == 0 and m[("clef_near_tie_margin", ())] == 0.05
    assert m[("clef_max_in_flight", ())] == 32 and m[("clef_max_queue", ())] == 64       # 2 x max-batch-size 16
    assert m[("clef_model_load_seconds", ())] > 0


def test_soak_script_smoke(live, tmp_path):
    """bench/soak.py for a few seconds against the live server: every response checked, none lost."""
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--url", live.url, "--duration", "3",
                           "--concurrency", "6", "--sample-every", "1", "--pid", str(live.proc.pid),
                           "--out", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert summary["requests_detail"]["ok"] > 0 and summary["requests_detail"]["mismatched"] == 0
    assert summary["lost"] == 0 and summary["requests_detail"]["errors"] == {} and summary["responses_5xx"] == 0
    assert summary["memory"]["rss_mb"]["samples"] >= 2

