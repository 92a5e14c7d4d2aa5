"""The production surface of ``clef-systemone`` on one server with small limits: API keys, CORS, the
over-length refusal, admission control (in flight, queue, 429 with Retry-After), cancellation of a request
whose client went away or whose time ran out, the bulk concurrency bound and stream limit, the near-tie
counter, JSON logs, and the SIGTERM drain (the last test here: it stops the server).

Servers (started together, once for this module):
* ``ops``: 2 in flight, a queue of 1, 600 tokens, ``--over-length reject``, two API keys, CORS for one
  origin, JSON logs, 2 records per bulk stream and 1 stream, every body's CPU work in the pool;
* ``timeouts``: ``--request-timeout 1``, its engine answering at once (the ``instant`` fault hook).
Both have the ``hold_dir`` fault hook: a decision with a question id ``hold.NAME`` stays in the engine until
the test creates ``NAME`` in the hold folder, so "in flight", "queue full" and "draining" are states the tests
create, not races.
"""

from __future__ import annotations

import json
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import REQUEST, LiveServer
from support.server_calls import (NDJSON, RawHttp, assert_error, held, metric, post, release as release_held,
                                  wait_until)

OPS_KEYS = ("k-one", "k-two")
AUTH = {"Authorization": f"Bearer {OPS_KEYS[0]}"}
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def servers(tiny_release, cache_dir, tmp_path_factory):
    holds = tmp_path_factory.mktemp("holds")
    model = ["--model", str(tiny_release), "--backend", "reference"]
    hold = {"CLEF_VLLM_FAULTS": f"hold_dir={holds}"}
    ops_args = model + ["--max-model-len", "600", "--over-length", "reject", "--max-in-flight", "2", "--max-queue", "1",
                        "--request-timeout", "120", "--bulk-concurrency", "2", "--max-bulk-streams", "1",
                        "--api-key", OPS_KEYS[0], "--api-key", OPS_KEYS[1], "--cors-origins", ORIGIN,
                        "--log-format", "json", "--near-tie-margin", "1.0",
                        "--cpu-inline-bytes", "0"]       # every body's CPU work in the pool (the others: small ones inline)
    started = {"ops": LiveServer(ops_args, env=hold),
               # the engine answers at once but for held decisions: the request after the timeout is
               # answered whatever the machine's load (the hook holds its decisions outside any backend)
               "timeouts": LiveServer(model + ["--request-timeout", "1"],
                                      env={"CLEF_VLLM_FAULTS": f"instant,hold_dir={holds}"})}
    yield {**started, "holds": holds}
    for server in started.values():             # signal both first: they shut down in parallel
        if server.proc.poll() is None:
            server.proc.terminate()
    for server in started.values():
        server.stop()


def release(servers, *names: str) -> None:
    release_held(servers["holds"], *names)


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
