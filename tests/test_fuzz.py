"""Fuzzing, CI size (a few hundred generated requests; a couple of minutes at most):

* schemathesis against the live server's own OpenAPI document (positive and negative data for
  ``POST /v1/systemone``, every GET route), with its response-conformance checks;
* hypothesis-generated hostile bodies (tests/fuzz/strategies.py) against ``POST /v1/systemone``
  and as NDJSON lines against ``POST /v1/systemone/bulk``; valid requests with hostile content
  (special tokens, any Unicode, huge numbers, long states) must be answered;
* the request model and the encoder in-process on the real Qwen3.5 tokenizer: nothing but a
  RequestError ever escapes, and every encoded request keeps its invariants.

Criterion everywhere: no response >= 500, the server never dies, every error has the dialect's
envelope. The long run (>= 10,000 requests) is ``tests/fuzz/run_long.py``; its summary is committed
as ``bench/results/fuzz_long.json``.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.strategies import (check_encoding, check_response, check_valid_response, raw_bodies, requests,
                             valid_requests)

NDJSON = {"Content-Type": "application/x-ndjson"}
CI = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck),
              print_blob=True)


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.url, timeout=120) as client:
        yield client
    assert live_server.proc.poll() is None, live_server.log()


def test_schemathesis_against_the_openapi_document(live_server):
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                     status_code_conformance)

    schema = schemathesis.openapi.from_url(live_server.url + "/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    seen: dict[str, dict[int, int]] = {}

    def run(path: str, method: str, mode, examples: int):
        operation = schema[path][method]
        label = f"{method} {path} {mode.value}"

        @settings(CI, max_examples=examples)
        @given(case=operation.as_strategy(generation_mode=mode))
        def one(case):
            response = case.call(base_url=live_server.url, timeout=120)
            counts = seen.setdefault(label, {})
            counts[response.status_code] = counts.get(response.status_code, 0) + 1
            case.validate_response(response, checks=checks)

        one()

    run("/v1/systemone", "POST", GenerationMode.POSITIVE, 120)
    run("/v1/systemone", "POST", GenerationMode.NEGATIVE, 120)
    for path in ("/health", "/health/live", "/metrics", "/v1/models"):
        run(path, "GET", GenerationMode.POSITIVE, 3)
    positive = seen["POST /v1/systemone positive"]
    assert positive.get(200, 0) > 0 and positive.get(422, 0) > 0          # both outcomes were exercised
    assert all(code < 500 for counts in seen.values() for code in counts)


@settings(CI, max_examples=250)
@given(body=raw_bodies)
def test_hostile_bodies_never_get_a_server_error(http, body):
    resp = http.post("/v1/systemone", content=body, headers={"Content-Type": "application/json"})
    problem = check_response(resp.status_code, resp.headers, resp.content, body)
    assert problem is None, problem


@settings(CI, max_examples=40)
@given(body=valid_requests)
def test_valid_requests_with_hostile_content_are_answered(http, body):
    resp = http.post("/v1/systemone", json=body)
    assert check_response(resp.status_code, resp.headers, resp.content, json.dumps(body).encode()) is None
    problem = check_valid_response(resp.status_code, resp.content, body)
    assert problem is None, problem


@settings(CI, max_examples=25)
@given(lines=st.lists(raw_bodies.filter(lambda b: b"\n" not in b and b"\r" not in b), min_size=1, max_size=5))
def test_bulk_lines_fail_alone(http, lines):
    resp = http.post("/v1/systemone/bulk", content=b"\n".join(lines) + b"\n", headers=NDJSON)
    assert resp.status_code == 200
    out = [json.loads(x) for x in resp.content.split(b"\n") if x]
    records = [i for i, line in enumerate(lines) if line.strip()]
    assert out[-1]["summary"]["records"] == len(records) and out[-1]["summary"]["aborted"] is None
    assert sorted(o["index"] for o in out[:-1]) == records
    for o in out[:-1]:
        problem = check_response(o["status"], {"x-request-id": "-", "server-timing": "-"},
                                 json.dumps(o["body"]).encode(), lines[o["index"]])
        assert problem is None, (o["index"], problem)


@pytest.fixture(scope="module")
def encoder_4096(hf_tok):
    """The request encoder on the real Qwen3.5 tokenizer (the session's), with a 4,096-token budget."""
    from clef_vllm.schema.encoding import RequestEncoder

    return RequestEncoder(hf_tok, max_length=4096)


@settings(CI, max_examples=300)
@given(body=st.one_of(requests, valid_requests))
def test_request_model_and_encoder_only_raise_request_errors(encoder_4096, body):
    check_encoding(encoder_4096, body)
