"""``clef-systemone`` as a real uvicorn subprocess on loopback: every success and error path,
and the production surface (limits, admission control, auth, metrics, logs, bulk, shutdown, faults).

Servers used (started in parallel, once per module):
* ``live_server`` (conftest): reference dialect, defaults;
* ``limits``: reference dialect with ``--max-model-len 600 --max-body-bytes 8192``;
* ``hosted``: ``--dialect workers-ai``;
* ``gated``: loading held by ``CLEF_VLLM_LOAD_GATE`` (server/faults.py) until the test creates the
  gate file, so the 503 "loading" state is observed deterministically, not by racing the loader;
* ``broken``: ``--model`` pointing at a folder without a head; it must exit non-zero and say why;
* ``ops``: small limits (2 in flight, a queue of 1, 600 tokens, ``--over-length reject``), two API
  keys, CORS for one origin, JSON logs, 2 records per bulk stream and 1 stream; decisions with a
  question id ``hold.NAME`` stay in the engine until the test creates ``NAME`` in the hold folder
  (``CLEF_VLLM_FAULTS=hold_dir=...``), so "in flight", "queue full" and "draining" are states the
  tests create, not races. Its last test sends SIGTERM;
* ``timeouts``: ``--request-timeout 1`` and the same hold hook (a held request always times out);
* ``dying`` / ``dying_load``: a stand-in engine process (``engine_pid_file``) that the tests kill
  while serving / while loading; ``slow_load``: ``--load-timeout 1`` with the load held;
  ``stopped_load``: SIGTERM while the load is held; ``slow_load`` and ``stopped_load`` have a
  stand-in engine too, which must not outlive them;
* ``corrupt-*``: checkpoints with a damaged file; the CLI must refuse to start and name the file.

Nothing here asserts on durations: waits poll a state (``/metrics``, ``/health``, a log line) with
a generous bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import REPO, REQUEST, LiveServer



NDJSON = {"Content-Type": "application/x-ndjson"}
OPS_KEYS = ("k-one", "k-two")
AUTH = {"Authorization": f"Bearer {OPS_KEYS[0]}"}
ORIGIN = "https://app.example"


def corrupt_variants(src: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """Copies of ``src`` with one damaged file each -> (folder, the file the error must name)."""
    out = {}

    def variant(name, damage):
        folder = root / f"corrupt-{name}"
        shutil.copytree(src, folder)
        out[name] = (folder, str(damage(folder)))

    def truncate_shard(folder):
        shard = sorted(folder.glob("model-*.safetensors"))[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        return shard

    def garbage_head(folder):
        (folder / "joint_head.safetensors").write_bytes(os.urandom(4096))
        return folder / "joint_head.safetensors"

    def broken_tokenizer(folder):
        (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
        return folder / "tokenizer.json"

    variant("shard", truncate_shard)
    variant("head", garbage_head)
    variant("tokenizer", broken_tokenizer)
    return out


@pytest.fixture(scope="module")
def servers(request, tiny_release, cache_dir, tmp_path_factory):
    """Start every extra server at once (they load in parallel), then the shared live server."""
    tmp = tmp_path_factory.mktemp("servers")
    nohead = tmp / "no-head"
    shutil.copytree(tiny_release, nohead)
    (nohead / "joint_head.safetensors").unlink()
    (nohead / "joint_head_config.json").unlink()
    gate, never = tmp / "gate", tmp / "never"
    holds = tmp / "holds"
    holds.mkdir()
    model = ["--model", str(tiny_release), "--backend", "reference"]
    ops_args = model + ["--max-model-len", "600", "--over-length", "reject", "--max-in-flight", "2", "--max-queue", "1",
                        "--request-timeout", "120", "--bulk-concurrency", "2", "--max-bulk-streams", "1",
                        "--api-key", OPS_KEYS[0], "--api-key", OPS_KEYS[1], "--cors-origins", ORIGIN,
                        "--log-format", "json", "--near-tie-margin", "1.0",
                        "--cpu-inline-bytes", "0"]       # every body's CPU work in the pool (the others: small ones inline)
    nodocs = tmp / "no-docs" / "fastapi_offline"           # the "limits" server runs without fastapi-offline
    nodocs.mkdir(parents=True)
    (nodocs / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
    hide_docs = {"PYTHONPATH": os.pathsep.join(filter(None, [str(nodocs.parent), os.environ.get("PYTHONPATH")]))}
    started = {
        "limits": LiveServer(model + ["--max-model-len", "600", "--max-body-bytes", "8192"], env=hide_docs),
        "hosted": LiveServer(model + ["--dialect", "workers-ai", "--gc-freeze", "off"]),
        "gated": LiveServer(model, env={"CLEF_VLLM_LOAD_GATE": str(gate)}),
        "broken": LiveServer(["--model", str(nohead), "--backend", "reference"]),
        "ops": LiveServer(ops_args, env={"CLEF_VLLM_FAULTS": f"hold_dir={holds}"}),
        "dying": LiveServer(model, env={"CLEF_VLLM_FAULTS": f"hold_dir={holds},engine_pid_file={tmp / 'engine.pid'}"}),
        "dying_load": LiveServer(model, env={"CLEF_VLLM_LOAD_GATE": str(never),
                                             "CLEF_VLLM_FAULTS": f"engine_pid_file={tmp / 'load-engine.pid'}"}),
        "slow_load": LiveServer(model + ["--load-timeout", "1"], env={
            "CLEF_VLLM_LOAD_GATE": str(never), "CLEF_VLLM_FAULTS": f"engine_pid_file={tmp / 'slow-engine.pid'}"}),
        "stopped_load": LiveServer(model, env={"CLEF_VLLM_LOAD_GATE": str(never),
                                               "CLEF_VLLM_FAULTS": f"engine_pid_file={tmp / 'stopped-engine.pid'}"}),
        "timeouts": LiveServer(model + ["--request-timeout", "1"], env={"CLEF_VLLM_FAULTS": f"hold_dir={holds}"}),
    }
    corrupt = corrupt_variants(tiny_release, tmp)
    for name, (folder, _) in corrupt.items():
        started[f"corrupt-{name}"] = LiveServer(["--model", str(folder), "--backend", "reference"])
    started.update(gate=gate, holds=holds, tmp=tmp, corrupt=corrupt)
    started["live"] = request.getfixturevalue("live_server")
    yield started
    gate.touch()
    mine = [server for name, server in started.items() if isinstance(server, LiveServer) and name != "live"]
    for server in mine:                          # signal all first: they shut down in parallel
        if server.proc.poll() is None:
            server.proc.terminate()
    for server in mine:
        server.stop()
    for pid_file in tmp.glob("*.pid"):          # stand-in engines exit with their server; be sure
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


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


def test_server_without_fastapi_offline_serves_without_doc_pages(limits):
    """A missing fastapi-offline (an install that skipped a dependency) turns /docs and /redoc off with one
    warning; the server and /openapi.json still work."""
    assert httpx.get(limits.url + "/docs", timeout=10).status_code == 404
    assert httpx.get(limits.url + "/redoc", timeout=10).status_code == 404
    assert "/v1/systemone" in httpx.get(limits.url + "/openapi.json", timeout=10).json()["paths"]
    assert post(limits, REQUEST).status_code == 200
    assert "fastapi-offline is not installed" in limits.log()


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


#: A valid 1x1 PNG: media pass validation (tests/test_media*.py), then this build's text-only 400.
PNG_1X1 = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="

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
    (json.dumps(REQUEST | {"images": [PNG_1X1]}).encode(), 400, "not supported by this build", "images"),
    (json.dumps(REQUEST | {"videos": [[PNG_1X1, PNG_1X1]]}).encode(), 400, "not supported by this build", "videos"),
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


def test_body_too_large_is_413(limits):
    big = REQUEST | {"state": "x" * 10000}
    assert_error(post(limits, big), 413, "body exceeds 8192 bytes")

    def chunks():                           # no Content-Length: the streaming limit applies
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    resp = httpx.post(limits.url + "/v1/systemone", content=chunks(), timeout=60,
                      headers={"Content-Type": "application/json"})
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


def test_gc_freeze_off_leaves_start_up_objects_in_the_collections(hosted):
    """``--gc-freeze off`` (the hosted-dialect server runs with it): nothing frozen, no freeze logged, the full
    collections still timed on /metrics."""
    m = metrics_of(hosted)
    assert m[("clef_gc_frozen_objects", ())] == 0 and ("clef_gc_pause_seconds", ()) in m
    assert "objects from start-up frozen" not in hosted.log()


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
    (json.dumps(REQUEST | {"images": [PNG_1X1]}).encode(), 400, 6003, "not supported"),
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


# --------------------------------------------------------------------------- helpers for the production surface


def metrics_of(server: LiveServer, headers=None) -> dict:
    """``{(sample name, sorted label items): value}`` from ``GET /metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = httpx.get(server.url + "/metrics", headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


def metric(server: LiveServer, name: str, **labels) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in metrics_of(server).items()
               if n == name and all(dict(ls).get(k) == str(w) for k, w in labels.items()))


def wait_until(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def held(name: str, **fields) -> dict:
    """A request that stays in the engine until the test creates ``holds/name`` (fault hook)."""
    return {"model": "clef-flash", "state": f"held {name}", "questions": {f"hold.{name}": {"type": "noul"}}, **fields}


def release(servers, *names: str) -> None:
    for name in names:
        (servers["holds"] / name).touch()


def server_timing(resp: httpx.Response) -> dict[str, float]:
    out = {}
    for part in resp.headers["server-timing"].split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur)
    return out


class RawHttp:
    """A bare HTTP/1.1 client: stream a request body and read the response while still sending it
    (httpx writes the whole body before it reads), or send part of a body and stop."""

    def __init__(self, server: LiveServer, path: str, headers: dict | None = None, content_length: int | None = None):
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        self.reader = self.sock.makefile("rb")
        self.chunked = content_length is None
        media = "application/x-ndjson" if path.endswith("/bulk") else "application/json"
        head = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{server.port}", f"Content-Type: {media}",
                *(f"{k}: {v}" for k, v in (headers or {}).items()),
                "Transfer-Encoding: chunked" if self.chunked else f"Content-Length: {content_length}"]
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        self._buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)

    def send_line(self, obj) -> None:
        self.send((obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n")

    def end(self) -> None:
        if self.chunked:
            self.sock.sendall(b"0\r\n\r\n")

    def response_head(self) -> tuple[int, dict]:
        status = int(self.reader.readline().split()[1])
        headers = {}
        while (line := self.reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        return status, headers

    def read_line(self) -> dict:
        """The next NDJSON line of a chunked response."""
        while b"\n" not in self._buf:
            size = int(self.reader.readline().strip(), 16)
            if size == 0:
                raise EOFError("response ended")
            self._buf += self.reader.read(size)
            self.reader.readline()
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def read_json_response(self) -> tuple[int, dict]:
        status, headers = self.response_head()
        return status, json.loads(self.reader.read(int(headers["content-length"])))

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


# --------------------------------------------------------------------------- metrics, timing, request ids (live)


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


# --------------------------------------------------------------------------- bulk endpoint (live)


def test_bulk_answers_each_line_like_the_single_endpoint(live):
    lines = [json.dumps(REQUEST | {"model": "line-0"}), "this is not json", "",
             json.dumps({"model": "line-3", "state": "x", "questions": {}}),
             json.dumps(REQUEST | {"model": "line-4", "state": {"deep": [1, {"ü": None}]}}), "   ",
             json.dumps(REQUEST | {"images": ["data:image/png;base64,AAAA"]}),
             json.dumps(REQUEST | {"model": "odd\u2028line\u0085breaks"}, ensure_ascii=False)]
    resp = httpx.post(live.url + "/v1/systemone/bulk", content=("\n".join(lines) + "\n").encode(), timeout=60,
                      headers={"X-Request-Id": "bulk-job-1", **NDJSON})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/x-ndjson")
    assert resp.headers["x-request-id"] == "bulk-job-1"
    out = [json.loads(line) for line in resp.text.splitlines()]   # U+2028/U+0085 stay escaped: one line each
    assert out[-1] == {"summary": {"records": 6, "ok": 3, "failed": 3, "aborted": None}}
    records = {o["index"]: o for o in out[:-1]}
    assert sorted(records) == [0, 1, 3, 4, 6, 7]                   # blank lines skipped, still counted
    assert records[7]["body"]["model"] == "odd\u2028line\u0085breaks"
    for index, line in enumerate(lines):
        if index not in records:
            continue
        single = post(live, content=line.encode())
        assert records[index]["status"] == single.status_code, (index, records[index])
        if single.status_code != 200:
            assert records[index]["body"] == single.json()
        else:
            got, want = records[index]["body"], single.json()
            assert got["model"] == want["model"] and got["usage"] == want["usage"]
            assert list(got["answers"]) == list(want["answers"])
            assert abs(got["answers"]["urgent"]["noul"] - want["answers"]["urgent"]["noul"]) <= 1e-2
    assert 'invalid_request_error' in resp.text and "Traceback" not in live.log()


def test_bulk_streams_a_line_per_record_while_the_body_is_still_being_sent(live):
    raw = RawHttp(live, "/v1/systemone/bulk", headers={"X-Request-Id": "stream-1", "Expect": "100-continue"})
    try:
        assert raw.response_head()[0] == 100             # curl-style clients wait for it before the body
        raw.send_line(REQUEST | {"model": "first"})
        status, headers = raw.response_head()
        assert status == 200 and headers["x-request-id"] == "stream-1" and "content-length" not in headers
        first = raw.read_line()                         # answered before the next line exists
        assert first["index"] == 0 and first["status"] == 200 and first["body"]["model"] == "first"
        raw.send(b'{"model": "second", "state": ')       # a line split across two writes
        raw.send(b'"x", "questions": {"q": {"type": "noul"}}}\n')
        second = raw.read_line()
        assert second["index"] == 1 and second["body"]["model"] == "second"
        raw.send_line(b"[1, 2")
        raw.end()
        assert raw.read_line()["status"] == 400
        assert raw.read_line() == {"summary": {"records": 3, "ok": 2, "failed": 1, "aborted": None}}
    finally:
        raw.close()


def test_bulk_line_over_the_size_cap_fails_alone(limits):
    big = json.dumps(REQUEST | {"state": "y" * 9000})               # > --max-body-bytes 8192
    body = "\n".join([json.dumps(REQUEST | {"model": "a"}), big, json.dumps(REQUEST | {"model": "c"})])
    out = [json.loads(x) for x in httpx.post(limits.url + "/v1/systemone/bulk", content=body, timeout=60, headers=NDJSON).text.splitlines()]
    by_index = {o["index"]: o for o in out[:-1]}
    assert by_index[1]["status"] == 413 and "line exceeds 8192 bytes" in by_index[1]["body"]["error"]["message"]
    assert by_index[0]["body"]["model"] == "a" and by_index[2]["body"]["model"] == "c"
    assert out[-1]["summary"] == {"records": 3, "ok": 2, "failed": 1, "aborted": None}


def test_truncation_is_reported_and_counted(limits):
    before = metric(limits, "clef_truncations_total"), metric(limits, "clef_truncated_state_tokens_total")
    body = post(limits, REQUEST | {"state": "word " * 1500}).json()
    cut = body["usage"]["truncated_state_tokens"]
    assert cut > 900
    assert metric(limits, "clef_truncations_total") == before[0] + 1
    assert metric(limits, "clef_truncated_state_tokens_total") == before[1] + cut


def test_soak_script_smoke(live, tmp_path):
    """bench/soak.py for a few seconds against the live server: every response checked, none lost."""
    import subprocess
    import sys

    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--url", live.url, "--duration", "3",
                           "--concurrency", "6", "--sample-every", "1", "--pid", str(live.proc.pid),
                           "--out", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert summary["requests_detail"]["ok"] > 0 and summary["requests_detail"]["mismatched"] == 0
    assert summary["lost"] == 0 and summary["requests_detail"]["errors"] == {} and summary["responses_5xx"] == 0
    assert summary["memory"]["rss_mb"]["samples"] >= 2


# --------------------------------------------------------------------------- ops server: auth, CORS, limits, admission


@pytest.fixture(scope="module")
def ops(servers) -> LiveServer:
    return servers["ops"].wait_ready()


def opost(server: LiveServer, body=None, *, content=None, headers=None) -> httpx.Response:
    return post(server, body, content=content, headers={**AUTH, **(headers or {})})


def test_api_key_guards_v1_routes_only(ops):
    for headers in ({}, {"Authorization": "Basic k-one"}, {"Authorization": "Bearer k-three"},
                    {"Authorization": "Bearer"}, {"Authorization": "Bearer k-one-and-more"}, {"Authorization": "k-one"}):
        resp = post(ops, REQUEST, headers=headers)
        assert_error(resp, 401, "missing or invalid API key")
        assert resp.headers["www-authenticate"] == "Bearer" and "x-request-id" in resp.headers
    for key in OPS_KEYS:
        assert post(ops, REQUEST, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(ops.url + "/v1/models").status_code == 401
    assert httpx.get(ops.url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.post(ops.url + "/v1/systemone/bulk", content=b"{}\n", headers=NDJSON).status_code == 401
    for path in ("/health", "/health/live", "/metrics", "/openapi.json", "/docs"):   # open unless --auth-health-metrics
        assert httpx.get(ops.url + path).status_code == 200, path
    assert metric(ops, "clef_requests_total", route="/v1/systemone", status=401, reason="unauthorized") == 6


def test_cors_is_opt_in_per_origin(ops):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = httpx.options(ops.url + "/v1/systemone", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN  # no key needed
    refused = httpx.options(ops.url + "/v1/systemone", headers={"Origin": "https://other.example", **preflight})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    resp = opost(ops, REQUEST, headers={"Origin": ORIGIN})
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == ORIGIN
    assert {"server-timing", "x-request-id", "retry-after"} <= set(resp.headers["access-control-expose-headers"]
                                                                   .lower().replace(" ", "").split(","))


def test_over_length_reject_names_the_token_counts(ops):
    body = assert_error(opost(ops, REQUEST | {"state": "word " * 1500}), 413, "maximum is 600 (--max-model-len)",
                        "--over-length reject", param="state")
    need, state = map(int, re.search(r"needs (\d+) tokens \(state (\d+)", body["error"]["message"]).groups())
    assert need > 600 and 1000 < state < need
    many = REQUEST | {"questions": {f"q{i}": {"type": "noul"} for i in range(12)}}
    assert_error(opost(ops, many), 413, "schema requires", "maximum is 600", param="questions")  # always refused
    assert opost(ops, REQUEST).json()["usage"]["truncated_state_tokens"] == 0
    assert metric(ops, "clef_requests_total", status=413, reason="too_many_tokens") == 1
    assert metric(ops, "clef_requests_total", status=413, reason="schema_too_long") == 1
    assert metric(ops, "clef_truncations_total") == 0


def test_full_engine_and_queue_answer_429_with_retry_after(ops, servers):
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(opost, ops, held("a1"))
        wait_until(lambda: metric(ops, "clef_in_flight") == 1, "a1 in the engine")
        second = pool.submit(opost, ops, held("a2"))
        wait_until(lambda: metric(ops, "clef_in_flight") == 2, "a2 in the engine")
        queued = pool.submit(opost, ops, held("a3"))
        wait_until(lambda: metric(ops, "clef_queue_depth") == 1, "a3 queued")
        refused = opost(ops, REQUEST)
        assert_error(refused, 429, "at capacity (2 in flight, 1 queued)")
        assert int(refused.headers["retry-after"]) >= 1
        assert httpx.get(ops.url + "/health").status_code == 200           # busy, not broken
        release(servers, "a1", "a2", "a3")
        assert [f.result().status_code for f in (first, second, queued)] == [200, 200, 200]
    wait_until(lambda: metric(ops, "clef_in_flight") == 0, "slots released")
    assert metric(ops, "clef_queue_depth") == 0
    assert metric(ops, "clef_requests_total", status=429, reason="queue_full") == 1


def test_a_timed_out_request_is_cancelled_in_the_engine(servers):
    timeouts: LiveServer = servers["timeouts"].wait_ready()          # --request-timeout 1
    resp = post(timeouts, held("t1"), headers={"X-Request-Id": "timeout-t1"})
    assert_error(resp, 504, "did not finish within 1 s (--request-timeout)", "cancelled")
    wait_until(lambda: "held decision t1 cancelled" in timeouts.log(), "the engine call cancelled")
    line = next(x for x in timeouts.log().splitlines() if "held decision t1 cancelled" in x)
    assert "[timeout-t1]" in line                                     # logged under the request's id
    wait_until(lambda: metric(timeouts, "clef_in_flight") == 0, "slot released")
    assert metric(timeouts, "clef_requests_total", status=504, reason="timeout") == 1
    assert metric(timeouts, "clef_engine_cancellations_total") == 1
    assert post(timeouts, REQUEST).status_code == 200                 # the engine is free again


def test_a_client_that_goes_away_is_cancelled_in_the_engine(ops):
    body = json.dumps(held("d1")).encode()
    raw = RawHttp(ops, "/v1/systemone", headers={**AUTH, "X-Request-Id": "gone-d1"}, content_length=len(body))
    raw.send(body)
    wait_until(lambda: metric(ops, "clef_in_flight") == 1, "d1 in the engine")
    raw.close()
    wait_until(lambda: "held decision d1 cancelled" in ops.log(), "the engine call cancelled")
    wait_until(lambda: metric(ops, "clef_in_flight") == 0, "slot released")
    wait_until(lambda: metric(ops, "clef_requests_total", status=499, reason="client_closed") == 1, "counted")


def test_bulk_concurrency_bound_and_stream_limit(ops, servers):
    raw = RawHttp(ops, "/v1/systemone/bulk", headers=AUTH)
    try:
        for name in ("b1", "b2", "b3"):
            raw.send_line(held(name))
        wait_until(lambda: metric(ops, "clef_in_flight") == 2, "two records in the engine")
        assert metric(ops, "clef_bulk_records_in_progress") == 2      # --bulk-concurrency 2: b3 is not read yet
        second = httpx.post(ops.url + "/v1/systemone/bulk", content=json.dumps(REQUEST) + "\n",
                            headers={**AUTH, **NDJSON})
        assert_error(second, 429, "bulk streams are open (--max-bulk-streams)")
        assert int(second.headers["retry-after"]) >= 1
        release(servers, "b2")
        assert raw.response_head()[0] == 200
        assert raw.read_line()["index"] == 1                             # b2 finished first: its line first
        wait_until(lambda: metric(ops, "clef_bulk_records_in_progress") == 2, "b3 read once a slot freed")
        release(servers, "b1", "b3")
        raw.end()
        rest = [raw.read_line() for _ in range(2)]
        assert sorted(r["index"] for r in rest) == [0, 2] and {r["status"] for r in rest} == {200}
        assert raw.read_line() == {"summary": {"records": 3, "ok": 3, "failed": 0, "aborted": None}}
    finally:
        raw.close()
    assert metric(ops, "clef_bulk_records_total", status=200, reason="ok") == 3


def test_near_tie_counter_follows_the_margin_flag(ops):
    """--near-tie-margin 1.0: every answer with two or more options is a near tie."""
    answers, ties = metric(ops, "clef_answers_total"), metric(ops, "clef_near_ties_total")
    assert opost(ops, REQUEST).status_code == 200
    assert metric(ops, "clef_answers_total") - answers == 3
    assert metric(ops, "clef_near_ties_total") - ties == 3
    assert metric(ops, "clef_near_tie_margin") == 1.0


def test_json_logs_carry_the_request_id_and_never_the_body(ops):
    marker = "SECRET-STATE-7f3a"
    assert opost(ops, REQUEST | {"state": marker}, headers={"X-Request-Id": "log-check-1"}).status_code == 200
    assert opost(ops, {"model": marker, "state": marker, "questions": {}},
                 headers={"X-Request-Id": "log-check-2"}).status_code == 422
    wait_until(lambda: '"log-check-2"' in ops.log(), "the access line")
    records = [json.loads(line) for line in ops.log().splitlines() if line.strip()]     # every line is JSON
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)
    ok = [r for r in records if r.get("request_id") == "log-check-1" and r["logger"] == "clef_vllm.access"]
    assert len(ok) == 1 and ok[0]["status"] == 200 and ok[0]["path"] == "/v1/systemone"
    assert ok[0]["input_tokens"] > 0 and ok[0]["questions"] == 3 and ok[0]["duration_ms"] > 0
    bad = [r for r in records if r.get("request_id") == "log-check-2"]
    assert bad and bad[-1]["status"] == 422 and bad[-1]["reason"] == "invalid"
    assert marker not in ops.log()


def test_sigterm_finishes_accepted_requests_refuses_new_ones_and_exits_0(ops, servers):
    with ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(opost, ops, held("s1"))
        wait_until(lambda: metric(ops, "clef_in_flight") == 1, "s1 in the engine")
        ops.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(ops.url + "/health").status_code == 503, "draining")
        assert httpx.get(ops.url + "/health").json() == {"status": "draining"}
        assert httpx.get(ops.url + "/health/live").status_code == 200
        assert_error(opost(ops, REQUEST), 503, "server is shutting down")
        assert httpx.post(ops.url + "/v1/systemone/bulk", content=b"\n", headers={**AUTH, **NDJSON}).status_code == 503
        assert ops.proc.poll() is None
        release(servers, "s1")
        assert accepted.result().status_code == 200
    assert ops.proc.wait(timeout=60) == 0
    assert "every accepted request was answered" in ops.log()


# --------------------------------------------------------------------------- faults


def health_code(server: LiveServer) -> int | None:
    try:
        return httpx.get(server.url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def test_engine_death_while_serving_fails_requests_and_exits_non_zero(servers):
    dying: LiveServer = servers["dying"].wait_ready()
    pid = int((servers["tmp"] / "engine.pid").read_text())
    body = json.dumps(REQUEST).encode()
    slow = RawHttp(dying, "/v1/systemone", content_length=len(body))  # accepted, its body still arriving
    slow.send(body[:10])
    stop, sent = threading.Event(), [10]

    def trickle():                                    # an upload that makes progress keeps being read
        while not stop.is_set() and sent[0] < len(body) - 2:
            slow.send(body[sent[0]:sent[0] + 1])
            sent[0] += 1
            time.sleep(0.1)

    with ThreadPoolExecutor(2) as pool:
        in_engine = pool.submit(post, dying, held("x1"))
        wait_until(lambda: metric(dying, "clef_in_flight") == 1, "x1 in the engine")
        trickling = pool.submit(trickle)
        os.kill(pid, signal.SIGKILL)
        assert_error(in_engine.result(), 503, "engine failed", f"engine process {pid} exited")
        health = httpx.get(dying.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "failed"}
        assert httpx.get(dying.url + "/health/live").status_code == 503
        assert_error(post(dying, REQUEST), 503, "engine failed")
        assert dying.proc.poll() is None              # it answers what it accepted before it exits
        stop.set()
        trickling.result()
    slow.send(body[sent[0]:])
    status, err = slow.read_json_response()
    assert status == 503 and "engine failed" in err["error"]["message"]
    slow.close()
    assert dying.proc.wait(timeout=60) == 1
    log = dying.log()
    assert "the engine failed while serving" in log and "Traceback" not in log


def test_engine_death_while_loading_exits_non_zero(servers):
    server: LiveServer = servers["dying_load"]
    pid_file = servers["tmp"] / "load-engine.pid"
    wait_until(lambda: pid_file.exists() and health_code(server) == 503, "loading with an engine process")
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert server.proc.wait(timeout=60) == 1
    assert "could not load the model: engine process" in server.log()


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_load_that_never_finishes_hits_the_load_timeout(servers):
    server: LiveServer = servers["slow_load"]
    assert server.proc.wait(timeout=120) == 1
    log = server.log()
    assert "the model did not load within 1 s (--load-timeout)" in log
    # the engine process the abandoned load had started does not outlive the server
    assert not running(int((servers["tmp"] / "slow-engine.pid").read_text())), log


def test_sigterm_while_loading_stops_the_engine_process_the_load_started(servers):
    """The stand-in is forked from the loading thread, as vLLM forks its engine cores, so it would
    inherit the server's drain handler and ignore SIGTERM: the server leaves no engine behind, and
    a plain SIGTERM is enough to stop it (no kill after the grace period)."""
    server: LiveServer = servers["stopped_load"]
    pid_file = servers["tmp"] / "stopped-engine.pid"
    wait_until(lambda: pid_file.exists() and health_code(server) == 503, "loading with an engine process")
    pid = int(pid_file.read_text())
    assert running(pid)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0
    log = server.log()
    assert not running(pid), log
    assert f"still running at exit: EngineCoreStandIn (pid {pid}); sending SIGTERM" in log
    assert "after SIGTERM: killed" not in log and "Traceback" not in log


@pytest.mark.parametrize("name", ["shard", "head", "tokenizer"])
def test_a_corrupted_checkpoint_file_refuses_to_start_naming_the_file(servers, name):
    server: LiveServer = servers[f"corrupt-{name}"]
    folder, damaged = servers["corrupt"][name]
    assert server.proc.wait(timeout=120) == 1
    log = server.log()
    assert "could not load the model" in log and "Traceback" not in log
    if name == "tokenizer":                            # the loader names the folder and the file names
        assert f"{folder}: cannot load the tokenizer (tokenizer.json" in log
    else:
        assert damaged in log and "unreadable safetensors file" in log


# --------------------------------------------------------------------------- units behind the server


CHILD_SIGNALS = """
import multiprocessing, signal, sys, time
from clef_vllm.server.children import default_signals_in_forked_children, stop_children
signal.signal(signal.SIGTERM, lambda *_: None)      # a handler that ignores SIGTERM, as a drain handler in a child
if sys.argv[1] == "reset":
    default_signals_in_forked_children()
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), name="child")
child.start()
print(stop_children(grace_s=2)[0].split(": ")[1])
"""


@pytest.mark.parametrize("mode,outcome", [("reset", "exited (-15)"), ("inherit", "killed")])
def test_forked_children_start_with_default_signals_and_are_stopped_at_exit(mode, outcome):
    """With the reset a forked child dies of SIGTERM at once; without it, it keeps its parent's
    handler, ignores SIGTERM and is killed after the grace period. Either way none is left."""
    run = subprocess.run([sys.executable, "-c", CHILD_SIGNALS, mode], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == outcome


def test_api_keys_come_from_flags_or_the_environment():
    from clef_vllm.server.cli import api_keys, build_parser

    parse = build_parser().parse_args
    assert api_keys(parse([]), {"CLEF_API_KEY": "key-a, key-b,"}) == ("key-a", "key-b")
    assert api_keys(parse(["--api-key", "x", "--api-key", "y,z"]), {"CLEF_API_KEY": "key-a"}) == ("x", "y", "z")
    assert api_keys(parse([]), {}) == ()
    with pytest.raises(SystemExit):
        parse(["--max-in-flight", "0"])
    assert parse([]).cpu_inline_bytes == 4096 and parse(["--cpu-inline-bytes", "0"]).cpu_inline_bytes == 0
    with pytest.raises(SystemExit):
        parse(["--cpu-inline-bytes", "-1"])


@pytest.mark.parametrize("argv,flag", [(["--body-timeout", "0", "--min-body-rate", "1000"], "--min-body-rate:"),
                                       (["--auth-health-metrics"], "--auth-health-metrics:")])
def test_a_flag_that_would_have_no_effect_is_a_start_up_error_not_ignored(argv, flag, capsys, monkeypatch):
    """--body-timeout 0 turns the pause and the rate rule off, so a rate given with it would be ignored;
    --auth-health-metrics without any API key would protect nothing (and the operator meant it to)."""
    from clef_vllm.server.cli import API_KEY_ENV, main

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "demo", *argv])
    assert exit_.value.code == 2 and flag in capsys.readouterr().err


def test_hosted_dialect_envelope_for_routing_errors(hosted):
    resp = httpx.get(hosted.url + "/nope")
    assert resp.status_code == 404 and resp.json()["errors"][0]["code"] == 7000
    assert "x-request-id" in resp.headers and "server-timing" in resp.headers



async def _settle(n: int = 5):
    for _ in range(n):
        await asyncio.sleep(0)


def test_admission_order_priority_bound_and_cancellation():
    from clef_vllm.server.admission import BULK, INTERACTIVE, Admission, QueueFull

    async def scenario():
        adm = Admission(max_in_flight=1, max_queue=1)
        await adm.acquire()
        order = []

        async def waiter(tag, kind):
            await adm.acquire(kind)
            order.append(tag)

        bulk = asyncio.create_task(waiter("bulk", BULK))
        await _settle()
        inter = asyncio.create_task(waiter("interactive", INTERACTIVE))
        await _settle()
        with pytest.raises(QueueFull):                  # interactive queue (1) full; bulk waits unbounded
            await adm.acquire(INTERACTIVE)
        adm.release(0.5)
        await _settle()
        assert order == ["interactive"]                 # interactive before an older bulk waiter
        adm.release(0.5)
        await _settle()
        assert order == ["interactive", "bulk"] and adm.in_flight == 1
        late = asyncio.create_task(waiter("late", INTERACTIVE))
        await _settle()
        late.cancel()
        await asyncio.gather(late, bulk, inter, return_exceptions=True)
        assert adm.waiting() == 0
        assert adm.retry_after() == 1
        adm.release()
        assert adm.in_flight == 0 and adm.idle
        # a saturating interactive load does not starve bulk records: every 4th contended slot is theirs
        adm = Admission(max_in_flight=1, max_queue=16)
        await adm.acquire()
        order.clear()
        tasks = [asyncio.create_task(waiter(f"b{i}", BULK)) for i in range(2)]
        await _settle()
        tasks += [asyncio.create_task(waiter(f"i{i}", INTERACTIVE)) for i in range(8)]
        await _settle()
        for _ in range(4):
            adm.release()
            await _settle()
        assert order == ["i0", "i1", "i2", "b0"]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_micro_batcher_drops_cancelled_requests_and_reports_batch_stats():
    from types import SimpleNamespace

    import torch

    from clef_vllm.backends.base import REQUEST_STATS, MicroBatcher, RequestStats, measure_stage

    gate, seen = threading.Event(), []

    def run(batch):
        seen.append([e.num_tokens for e in batch])
        if len(seen) == 1:
            gate.wait(60)
        with measure_stage("backbone"):
            pass
        return [torch.full((1,), float(e.num_tokens)) for e in batch]

    batcher = MicroBatcher(run, max_batch_size=8)

    def submit(n):
        stats = RequestStats()
        token = REQUEST_STATS.set(stats)
        try:
            return asyncio.ensure_future(batcher.submit(SimpleNamespace(num_tokens=n))), stats
        finally:
            REQUEST_STATS.reset(token)

    async def scenario():
        first, s1 = submit(1)
        while not seen:
            await asyncio.sleep(0.01)
        second, _ = submit(2)
        third, s3 = submit(3)
        fourth, s4 = submit(4)
        await _settle()
        second.cancel()
        await _settle()
        gate.set()
        assert [float((await f)[0]) for f in (first, third, fourth)] == [1.0, 3.0, 4.0]
        assert seen == [[1], [3, 4]] and batcher.dropped == 1 and batcher.batches == 2
        assert s1.batch_size == 1 and s3.batch_size == 2 and s3.first_in_batch and not s4.first_in_batch
        assert "backbone" in s3.stages and s3.run_s >= s3.stages["backbone"]

    try:
        asyncio.run(scenario())
    finally:
        batcher.close()


def test_micro_batcher_trims_after_a_batch_that_came_too_soon_once_it_is_idle():
    """A batch right after a trim is not trimmed for (at most one trim per interval), so its freed memory is
    trimmed once the queue has stayed empty for the interval: an idle server keeps no batch's free memory."""
    from types import SimpleNamespace

    import torch

    from clef_vllm.backends.base import MicroBatcher

    trims = []
    batcher = MicroBatcher(lambda batch: [torch.zeros(1) for _ in batch], trim_interval_s=0.3)
    batcher._trim = lambda pad: trims.append(batcher.batches)

    async def scenario():
        await batcher.submit(SimpleNamespace(num_tokens=1))        # trimmed after (the first trim is due)
        await batcher.submit(SimpleNamespace(num_tokens=2))        # too soon for its own trim
        for _ in range(200):
            if len(trims) == 2:
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(scenario())
    finally:
        batcher.close()
    assert trims == [1, 2]


def test_vllm_backend_cancels_in_the_engine_and_reports_a_dead_engine(tiny_release):
    """The vLLM backend's request path against a stand-in AsyncLLM (no GPU here)."""
    from support import vllm_cpu
    from vllm.v1.engine.exceptions import EngineDeadError

    from clef_vllm.backends.base import BackendDeadError
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.encoding import RequestEncoder

    started, cancelled = threading.Event(), threading.Event()

    class StandInEngine:
        errored = False

        def __init__(self, dead: bool):
            self.dead = dead

        async def encode(self, prompt, params, request_id):
            started.set()
            if self.dead:
                raise EngineDeadError()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:    # AsyncLLM.encode aborts the request in the engine core here
                cancelled.set()
                raise
            yield

    encoded = RequestEncoder.from_pretrained(tiny_release).encode(parse_request(REQUEST))
    with vllm_cpu.bare_vllm_backend(max_num_seqs=48, data_parallel_size=2) as backend:
        backend.engine = StandInEngine(dead=False)

        async def cancel_in_flight():
            task = asyncio.ensure_future(backend.decide(encoded))
            assert await asyncio.to_thread(started.wait, 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(cancelled.wait, 60)

        asyncio.run(cancel_in_flight())
        backend.engine = StandInEngine(dead=True)
        with pytest.raises(BackendDeadError, match="engine core died"):
            backend.decide_batch([encoded])
        backend.check_health()
        backend.engine.errored = True
        with pytest.raises(BackendDeadError, match="AsyncLLM.errored"):
            backend.check_health()
        assert backend.suggested_max_in_flight() == 96


def test_a_clean_sigterm_exits_0_every_time(tiny_release):
    """The reference backend (torch on CPU) after a real request: SIGTERM drains and exits 0, never
    an abort in the interpreter's teardown (exit 134 in about one run in three before the server
    left with ``os._exit`` once it had closed its backend; seen in a venv made by README's demo
    command, 3 of 6 runs, not in the test venv, so this guards the exit status rather than
    reproducing that abort)."""
    for _ in range(3):
        server = LiveServer(["--model", str(tiny_release), "--backend", "reference"]).wait_ready()
        try:
            assert server.call("/v1/systemone", REQUEST)[0] == 200
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(timeout=60) == 0, server.log()[-2000:]
            assert "terminate called" not in server.log()
        finally:
            server.stop()


def test_free_port_never_hands_out_one_port_twice(monkeypatch):
    """Servers started together each ask for a port before any binds one: when the system offers the same
    free port twice, the second asker gets another (two servers once shared a port and a log file)."""
    import socket

    from clef_vllm.testing import server as testing_server

    offered = iter([47001, 47001, 47002])

    class Offering:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            pass

        def getsockname(self):
            return ("127.0.0.1", next(offered))

    monkeypatch.setattr(testing_server, "_HANDED_OUT", set())
    monkeypatch.setattr(socket, "socket", lambda *a, **k: Offering())
    assert [testing_server.free_port(), testing_server.free_port()] == [47001, 47002]


def test_the_reference_backend_state_cache_through_the_server(tiny_release):
    """``clef-systemone --backend reference --state-cache on``: the second request about a long state reports its
    state's tokens in ``usage.cached_state_tokens`` and in ``/metrics`` as reused prompt tokens, with the
    answers of a server without the cache; the vLLM-only sub-options are refused for the reference backend."""
    import random

    words = "order invoice refund ticket outage payment account region cluster team".split()
    state = " ".join(random.Random(3).choice(words) for _ in range(1300))
    body = {"model": "m", "state": state, "questions": {"u": {"type": "noul", "instructions": "Urgent?"}}}
    on = LiveServer(["--model", str(tiny_release), "--backend", "reference", "--state-cache", "on",
                     "--dtype", "float32"]).wait_ready()
    off = LiveServer(["--model", str(tiny_release), "--backend", "reference", "--dtype", "float32"]).wait_ready()
    try:
        first, second = (post(on, body).json() for _ in range(2))
        plain = post(off, body).json()
        assert first["usage"]["cached_state_tokens"] == 0
        reused = second["usage"]["cached_state_tokens"]
        assert 1024 <= reused < second["usage"]["input_tokens"]
        assert abs(second["answers"]["u"]["noul"] - plain["answers"]["u"]["noul"]) < 1e-3
        metrics = httpx.get(on.url + "/metrics").text
        assert f'clef_prompt_tokens_total{{source="reused"}} {float(reused)}' in metrics
    finally:
        on.stop()
        off.stop()
    bad = subprocess.run([sys.executable, "-m", "clef_vllm.server.cli", "--model", str(tiny_release), "--backend",
                          "reference", "--state-cache", "on", "--state-cache-match", "block"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--state-cache-match" in bad.stderr
