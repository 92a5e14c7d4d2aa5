"""Adversarial clients against a real ``clef-systemone`` (reference backend, CPU), CI size.

The five defects an adversarial review found (D1-D5), the worst-case bodies (scaled down: the
structural limits are sized from ``--max-model-len``, here 2048, so a 2 MiB body is as hopeless as
a 16 MiB one at 16,384) and every slow, half-closed or vanishing client. Each must get a 4xx or a
clean answer; the last test checks that no response was >= 500 and no traceback was logged.

Servers (started in parallel, once per module):
* ``adv``: ``--max-model-len 2048``, 1 s header and 2 s body timeouts, a 2,000 B/s minimum body rate,
  2 bulk streams, 120 connections, 1.1 M bulk lines, and the ``hold.NAME`` fault hook (a decision stays in the
  engine until the test creates ``holds/NAME``);
* ``term``: an API key with ``--auth-health-metrics`` and ``--shutdown-timeout 5``, the engine
  answering at once (``instant`` fault hook) but for held decisions; its last test sends SIGTERM
  with stalled, progressing and never-finishing clients.

The measured targets (16 MiB bodies, CPU seconds, RSS, probe latency, exit time) are the long
runner's: ``python tests/adversarial/run_long.py`` (bench/results/adversarial_cpu.json).
Bounds on time here are generous: they catch a hang, not a slowdown.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from adversarial.attacks import (connect, dechunk, head, many_options, many_questions, ndjson,
                                 read_response, read_responses, state_keys, state_text, wait)
from clef_vllm.testing.bodies import nested_level, state_array
from conftest import LiveServer

REQUEST = {"model": "clef-flash", "state": "Checkout is down for everyone.",
           "questions": {"urgent": {"type": "noul", "instructions": "Is this urgent?"}}}
JSON = {"Content-Type": "application/json"}
NDJSON = {"Content-Type": "application/x-ndjson"}
KEY = "adv-key"
BULK_LINES = 1_100_000
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def servers(tiny_release, cache_dir, tmp_path_factory):
    holds = tmp_path_factory.mktemp("adv-holds")
    model = ["--model", str(tiny_release), "--backend", "reference"]
    faults = {"CLEF_VLLM_FAULTS": f"hold_dir={holds}"}
    started = {
        "adv": LiveServer(model + ["--max-model-len", "2048", "--header-timeout", "1", "--body-timeout", "2",
                                   "--min-body-rate", "2000", "--max-bulk-streams", "2", "--max-connections", "120",
                                   "--max-bulk-lines", str(BULK_LINES), "--cpu-workers", "2"], env=faults),
        # the engine answers at once (fault hook): a released request finishes well within the drain
        "term": LiveServer(model + ["--api-key", KEY, "--auth-health-metrics", "--shutdown-timeout", "5",
                                    "--body-timeout", "30", "--max-model-len", "2048"],
                           env={"CLEF_VLLM_FAULTS": f"instant,hold_dir={holds}"}),
    }
    yield {**started, "holds": holds}
    for server in started.values():
        if server.proc.poll() is None:
            server.proc.terminate()
    for server in started.values():
        server.stop()


@pytest.fixture(scope="module")
def adv(servers) -> LiveServer:
    return servers["adv"].wait_ready()


def term_ready(servers) -> LiveServer:
    """``term`` keeps /health behind its key: LiveServer.wait_ready cannot see it become ready."""
    term: LiveServer = servers["term"]

    def ready():
        assert term.proc.poll() is None, term.log()
        try:
            return httpx.get(term.url + "/health", headers=AUTH, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait(ready, 300, "the term server")
    return term


def post(server, body, headers=None, timeout=120) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + "/v1/systemone", content=content, headers={**JSON, **(headers or {})},
                      timeout=timeout)


def metric(server, name: str, headers=None, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", headers=headers, timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == str(v) for k, v in labels.items()))


def held(name: str) -> dict:
    return {"model": "clef-flash", "state": f"held {name}", "questions": {f"hold.{name}": {"type": "noul"}}}


def assert_clean_error(resp: httpx.Response, status: int, *fragments):
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json" and "Traceback" not in resp.text
    message = resp.json()["error"]["message"]
    for fragment in fragments:
        assert fragment in message, message


# --------------------------------------------------------------------------- D1: nesting


@pytest.mark.parametrize("depth", [130, 961, 963, 965, 966, 5000])
def test_d1_deeply_nested_fields_are_refused_cleanly(adv, depth):
    resp = post(adv, nested_level(depth))
    assert resp.status_code in (400, 413), resp.text
    assert "nested" in resp.json()["error"]["message"]
    assert post(adv, REQUEST).status_code == 200


# --------------------------------------------------------------------------- D2: disconnects


def test_d2_a_client_leaving_mid_upload_is_a_499_not_a_500(adv):
    before = metric(adv, "clef_requests_total", status=499, reason="client_closed")
    for _ in range(20):
        sock = connect(adv.port)
        sock.sendall(head("/v1/systemone", adv.port, content_length=1000) + b"{")
        time.sleep(0.01)
        sock.close()
    wait(lambda: metric(adv, "clef_requests_total", status=499, reason="client_closed") == before + 20, 30,
         "20 disconnects counted as 499")
    lines = [x for x in adv.log().splitlines() if "status=499" in x]
    assert len(lines) >= 20 and all(" INFO clef_vllm.access" in x and "reason=client_closed" in x for x in lines)


def test_a_client_leaving_while_its_request_is_in_the_engine_cancels_it(adv, servers):
    """End-of-file after a whole request: half-closed or gone? The 100 Continue probe tells (a gone
    client resets it), and the engine call is cancelled."""
    body = json.dumps(held("gone1")).encode()
    sock = connect(adv.port)
    sock.sendall(head("/v1/systemone", adv.port, content_length=len(body)) + body)
    wait(lambda: metric(adv, "clef_in_flight") == 1, 30, "the request in the engine")
    sock.close()
    wait(lambda: "held decision gone1 cancelled" in adv.log(), 30, "the engine call cancelled")
    wait(lambda: metric(adv, "clef_in_flight") == 0, 30, "the slot released")


# --------------------------------------------------------------------------- D3: bodies that cost more than their budget


@pytest.mark.parametrize("build, fragment", [(state_array, "JSON values"), (state_keys, "JSON values"),
                                             (many_questions, "JSON values"), (many_options, "JSON values")])
def test_d3_worst_case_bodies_are_refused_cheaply(adv, build, fragment):
    body = build(2 * 1024 * 1024)
    encoded = metric(adv, "clef_stage_seconds_count", stage="encode")
    resp = post(adv, body)
    assert_clean_error(resp, 413, fragment, "2048 tokens")
    # refused by counting its JSON values: nothing of it was tokenized
    assert "encode" not in resp.headers["server-timing"]
    assert metric(adv, "clef_stage_seconds_count", stage="encode") == encoded
    assert httpx.get(adv.url + "/health/live", timeout=5).status_code == 200


@pytest.mark.parametrize("build", [state_array, state_keys, many_questions, many_options])
def test_d3_worst_case_bodies_are_refused_cheaply_on_the_hosted_route_too(adv, build):
    resp = httpx.post(adv.url + "/accounts/acct/ai/run/@cf/cloudflare/clef-flash", content=build(2 * 1024 * 1024),
                      headers=JSON, timeout=120)
    assert resp.status_code == 413, resp.text
    error = resp.json()["errors"][0]
    assert error["code"] == 5021 and "JSON values" in error["message"] and "2048 tokens" in error["message"]


def test_d3_smaller_worst_cases_hit_the_count_limits(adv):
    assert_clean_error(post(adv, many_questions(6_000)), 413, "questions fit in 2048 tokens")
    assert_clean_error(post(adv, many_options(8_000)), 413, "options and levels")
    assert_clean_error(post(adv, {**REQUEST, "questions": {"q": {"type": "noul", "instructions": "x" * 300_000}}}),
                       413, "characters")


def test_d3_a_huge_state_is_answered_from_the_part_that_fits(adv):
    resp = post(adv, state_text(4 * 1024 * 1024))
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    # that only a prefix of the state is tokenized is counted in tests/test_encoding_pieces.py; here the request's
    # timeout only stops a hang
    assert usage["input_tokens"] == 2048 and usage["truncated_state_tokens"] > 500_000


def test_d3_the_body_memory_budget_and_size_cap_still_apply(adv):
    resp = httpx.post(adv.url + "/v1/systemone", content=b"x" * (17 * 1024 * 1024), headers=JSON, timeout=60)
    assert_clean_error(resp, 413, "body exceeds")


# --------------------------------------------------------------------------- D4: idle bulk streams


def test_d4_idle_bulk_connections_hold_no_slot_and_are_closed(adv):
    idle = []
    for _ in range(4):                                    # --max-bulk-streams 2: all of them idle
        sock = connect(adv.port)
        sock.sendall(head("/v1/systemone/bulk", adv.port, content_type="application/x-ndjson"))
        idle.append(sock)
    time.sleep(0.2)
    resp = httpx.post(adv.url + "/v1/systemone/bulk", content=ndjson([REQUEST, REQUEST]), headers=NDJSON, timeout=60)
    assert resp.status_code == 200
    assert json.loads(resp.text.splitlines()[-1]) == {"summary": {"records": 2, "ok": 2, "failed": 0, "aborted": None}}
    for sock in idle:                                     # --body-timeout 2: each gets a 408 and is closed
        status, headers, body = read_response(sock, 15)
        assert status == 408 and json.loads(body)["error"]["message"].startswith("request body too slow")
        sock.close()
    assert metric(adv, "clef_bulk_streams") == 0


def test_a_bulk_stream_that_pauses_with_nothing_in_progress_is_ended(adv):
    sock = connect(adv.port)
    sock.sendall(head("/v1/systemone/bulk", adv.port, content_type="application/x-ndjson"))
    line = json.dumps(REQUEST).encode() + b"\n"
    sock.sendall(b"%x\r\n%s\r\n" % (len(line), line))
    status, headers, body = read_response(sock, 30)
    lines = [json.loads(x) for x in dechunk(body).splitlines()]
    assert status == 200 and lines[0]["status"] == 200
    assert lines[-1]["summary"]["records"] == 1 and "--body-timeout" in lines[-1]["summary"]["aborted"]
    sock.close()


def test_a_bulk_client_that_waits_for_each_answer_keeps_its_stream(adv, servers):
    """Pauses while a record is in progress do not count: ping-pong over one stream works."""
    sock = connect(adv.port)
    sock.sendall(head("/v1/systemone/bulk", adv.port, content_type="application/x-ndjson"))
    received = b""

    def next_line(n):
        nonlocal received
        sock.settimeout(30)
        while len(dechunk(received.partition(b"\r\n\r\n")[2]).splitlines()) < n:
            received += sock.recv(65536)
        return json.loads(dechunk(received.partition(b"\r\n\r\n")[2]).splitlines()[n - 1])

    def send_line(obj):
        line = json.dumps(obj).encode() + b"\n"
        sock.sendall(b"%x\r\n%s\r\n" % (len(line), line))

    send_line(held("pingpong"))
    time.sleep(3)                                         # > --body-timeout, but the record is in progress
    (servers["holds"] / "pingpong").touch()
    assert next_line(1)["status"] == 200
    send_line(REQUEST)                                    # within --body-timeout of the answer
    assert next_line(2)["status"] == 200
    sock.sendall(b"0\r\n\r\n")
    assert next_line(3) == {"summary": {"records": 2, "ok": 2, "failed": 0, "aborted": None}}
    sock.close()


def test_a_bulk_client_that_disconnects_is_noticed_promptly(adv):
    before = metric(adv, "clef_bulk_records_total")
    sock = connect(adv.port)
    sock.sendall(head("/v1/systemone/bulk", adv.port, content_type="application/x-ndjson"))
    lines = ndjson([REQUEST | {"model": f"r{i}"} for i in range(3000)])
    sock.sendall(b"%x\r\n%s\r\n" % (len(lines), lines))
    wait(lambda: metric(adv, "clef_bulk_records_total") > before + 4, 60, "records answered")
    sock.close()
    wait(lambda: metric(adv, "clef_bulk_streams") == 0, 30, "the stream ended")
    done = metric(adv, "clef_bulk_records_total") - before
    assert done < 200, done                               # not thousands of records after the client left
    assert "bulk client disconnected" in adv.log()


# --------------------------------------------------------------------------- slow heads and bodies, connections


def test_slow_headers_are_cut_and_do_not_block_anyone(adv):
    slow = []
    for i in range(60):
        sock = connect(adv.port)
        sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"")
        slow.append(sock)
    assert post(adv, REQUEST).status_code == 200          # others are served meanwhile
    for i, sock in enumerate(slow):                       # --header-timeout 1
        status, _, body = read_response(sock, 15)
        if i % 2:
            assert status == 408 and b"--header-timeout" in body
        else:
            assert status is None                         # never sent a byte: just closed
        sock.close()


def test_a_body_slower_than_the_minimum_rate_gets_408(adv):
    body = json.dumps(REQUEST).encode()
    sock = connect(adv.port)
    sock.sendall(head("/v1/systemone", adv.port, content_length=len(body)))
    t0 = time.monotonic()
    status = None
    for byte in body:                                     # 1 byte every 0.2 s: under 2,000 B/s
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            break
        time.sleep(0.2)
        if time.monotonic() - t0 > 4:
            break
    status, _, text = read_response(sock, 15)
    assert status == 408 and b"--min-body-rate" in text
    sock.close()


def test_too_many_connections_get_503_and_others_recover(adv):
    from clef_vllm.server.connection import PROBE_CONNECTIONS

    socks = [connect(adv.port) for _ in range(120 + PROBE_CONNECTIONS + 10)]     # --max-connections 120
    refused = 0
    for sock in socks[120 + PROBE_CONNECTIONS - 5:]:
        status, _, body = read_response(sock, 5)
        refused += status == 503 and b"--max-connections" in body
    assert refused >= 10
    for sock in socks:
        sock.close()
    wait(lambda: post(adv, REQUEST).status_code == 200, 30, "served again")


def test_health_probes_are_answered_while_the_connections_are_full(adv):
    """A server whose connections are all taken still answers its probes, so an orchestrator never restarts
    a server that is merely busy: a few connections past --max-connections are kept for /health,
    /health/live and /metrics (each closed after its answer); anything else on them gets 503 naming the limit."""
    socks = [connect(adv.port) for _ in range(121)]                             # --max-connections 120, all idle
    try:
        for path in ("/health/live", "/health", "/metrics"):
            sock = connect(adv.port)
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            status, headers, _ = read_response(sock, 10)
            assert status == 200 and headers.get("connection") == "close", (path, status)
            sock.close()
        body = json.dumps(REQUEST).encode()
        sock = connect(adv.port)
        sock.sendall(head("/v1/systemone", adv.port, content_length=len(body)) + body)
        status, headers, text = read_response(sock, 10)
        assert status == 503 and headers.get("connection") == "close"
        assert b"--max-connections" in text and b"/health/live" in text
        sock.close()
    finally:
        for sock in socks:
            sock.close()
    wait(lambda: post(adv, REQUEST).status_code == 200, 30, "served again")
    assert metric(adv, "clef_requests_total", status=503, reason="connections") >= 1


def test_a_half_closed_client_gets_its_answer(adv):
    body = json.dumps(REQUEST).encode()
    sock = connect(adv.port)
    sock.sendall(head("/v1/systemone", adv.port, content_length=len(body)) + body)
    sock.shutdown(socket.SHUT_WR)
    status, headers, text = read_response(sock, 60)
    assert status == 200 and json.loads(text)["answers"]["urgent"]["type"] == "noul"
    sock.close()


# --------------------------------------------------------------------------- bulk bodies of many lines


def test_a_bulk_client_that_sent_its_whole_body_at_once_is_answered_not_timed_out(adv):
    """A million blank lines and two records, sent at once, with --body-timeout 2: a piece of the body is split
    in one call (no task, no await per line) and only waiting for bytes counts against the timeout, so the
    records are answered and the stream ends cleanly."""
    body = b"\n" * 1_000_000 + ndjson([REQUEST, REQUEST | {"model": "second"}])
    resp = httpx.post(adv.url + "/v1/systemone/bulk", content=body, headers=NDJSON, timeout=120)
    lines = [json.loads(x) for x in resp.text.splitlines()]
    assert resp.status_code == 200
    assert sorted(x["index"] for x in lines[:-1]) == [1_000_000, 1_000_001]
    assert lines[-1] == {"summary": {"records": 2, "ok": 2, "failed": 0, "aborted": None}}


def test_a_bulk_body_past_max_bulk_lines_gets_413_for_the_line_past_it_and_the_stream_ends(adv):
    body = ndjson([REQUEST]) + b"\n" * (BULK_LINES + 50_000) + ndjson([REQUEST])
    sock = connect(adv.port)
    sock.sendall(head("/v1/systemone/bulk", adv.port, content_length=len(body), content_type="application/x-ndjson"))
    try:
        sock.sendall(body)
    except OSError:
        pass                                          # the server may close before taking it all
    status, headers, raw = read_response(sock, 60)
    lines = [json.loads(x) for x in dechunk(raw).splitlines()]
    assert status == 200
    past = [x for x in lines[:-1] if x["index"] == BULK_LINES]
    assert past and past[0]["status"] == 413 and "--max-bulk-lines" in past[0]["body"]["error"]["message"]
    assert {x["index"] for x in lines[:-1]} == {0, BULK_LINES}
    summary = lines[-1]["summary"]
    assert summary["records"] == 2 and summary["ok"] == 1 and "--max-bulk-lines" in summary["aborted"]
    sock.settimeout(10)
    assert sock.recv(100) == b""                      # the rest is not read: the connection is closed
    sock.close()


# --------------------------------------------------------------------------- encodings, repeated keys


@pytest.mark.parametrize("codec, named", [("utf-16", "UTF-16"), ("utf-16-le", "UTF-16-LE"), ("utf-32", "UTF-32"),
                                          ("utf-32-be", "UTF-32-BE"), ("utf-8-sig", "byte order mark")])
def test_json_that_is_not_utf8_is_refused_naming_its_encoding(adv, codec, named):
    assert_clean_error(post(adv, json.dumps(REQUEST).encode(codec)), 400, named, "UTF-8")


def test_bytes_that_are_not_utf8_and_utf8_encoded_surrogates_are_refused(adv):
    assert_clean_error(post(adv, json.dumps(REQUEST).encode().replace(b"Checkout", b"Check\xff\xfeout")), 400,
                       "not valid UTF-8")
    assert_clean_error(post(adv, json.dumps(REQUEST).encode().replace(b"Checkout", b"Check\xed\xa0\x80out")), 400,
                       "not valid UTF-8")


@pytest.mark.parametrize("body, key", [
    (b'{"model":"m","state":"benign","questions":{"a":{"type":"noul"}},"state":"other"}', '"state"'),
    (b'{"model":"m","state":1,"questions":{"a":{"type":"noul"},"a":{"type":"score","criteria":["x","y"]}}}', '"a"'),
    (b'{"model":"m","state":{"k":1,"k":2},"questions":{"a":{"type":"noul"}}}', '"k"'),
])
def test_a_repeated_key_is_refused_naming_it(adv, body, key):
    """A proxy that reads the first of two values and a server that reads the last act on different requests."""
    assert_clean_error(post(adv, body), 422, "duplicate key", key)


@pytest.mark.parametrize("encoding", ["br", "gzip", "deflate", "identity, gzip"])
def test_a_compressed_body_is_refused_not_parsed(adv, encoding):
    import gzip

    resp = post(adv, gzip.compress(json.dumps(REQUEST).encode()), headers={"Content-Encoding": encoding})
    assert_clean_error(resp, 415, "Content-Encoding")
    bulk = httpx.post(adv.url + "/v1/systemone/bulk", content=ndjson([REQUEST]),
                      headers={**NDJSON, "Content-Encoding": encoding}, timeout=30)
    assert bulk.status_code == 415
    assert post(adv, REQUEST, headers={"Content-Encoding": "identity"}).status_code == 200


def test_bulk_lines_follow_the_same_json_rules(adv):
    body = ndjson([REQUEST]) + json.dumps(REQUEST).encode("utf-16-le") + b"\n" + \
        b'{"model":"m","model":"n","state":1,"questions":{"a":{"type":"noul"}}}\n'
    lines = {x["index"]: x for x in map(json.loads, httpx.post(
        adv.url + "/v1/systemone/bulk", content=body, headers=NDJSON, timeout=60).text.splitlines()[:-1])}
    assert lines[0]["status"] == 200 and lines[2]["status"] == 422
    assert "duplicate key" in lines[2]["body"]["error"]["message"]
    assert lines[1]["status"] == 400


# --------------------------------------------------------------------------- request ids on kept-alive connections


def test_a_request_read_after_another_on_its_connection_logs_under_its_own_id(adv):
    """A request that follows another on one connection (pipelined, or read when the first one's answer goes
    out) runs in a task of its own whose log context starts empty: its log lines (here uvicorn's for a request
    that is not HTTP) never carry the first request's id."""
    body = json.dumps(REQUEST).encode()
    rid = f"keep-{time.monotonic_ns()}"
    sock = connect(adv.port)
    sock.sendall(head("/v1/systemone", adv.port, content_length=len(body), extra={"X-Request-Id": rid}) + body
                 + head("/v1/systemone", adv.port, content_length=len(body), extra={"X-Request-Id": rid + "b"}) + body
                 + b"GARBAGE \x01 HTTP/9.9\r\n\r\n")
    first, second, third = read_responses(sock, 3)
    sock.close()
    assert (first[0], first[1]["x-request-id"]) == (200, rid)
    assert (second[0], second[1]["x-request-id"]) == (200, rid + "b")
    assert third[0] == 400
    def access_lines(request_id: str) -> int:
        return sum(f"[{request_id}]" in x and "clef_vllm.access" in x for x in adv.log().splitlines())

    # the access lines are written as the answers go out: on a busy machine after the client has read them
    wait(lambda: "Invalid HTTP request received" in adv.log() and access_lines(rid) and access_lines(rid + "b"), 10,
         "uvicorn's line and both access lines")
    lines = adv.log().splitlines()
    invalid = [x for x in lines if "Invalid HTTP request received" in x]
    assert invalid and not any(rid in x for x in invalid), invalid
    assert access_lines(rid) == 1 and access_lines(rid + "b") == 1


# --------------------------------------------------------------------------- routes


def test_no_redirect_builds_a_location_from_the_host_header(adv):
    resp = httpx.get(adv.url + "/health/", headers={"Host": "evil.example"})
    assert resp.status_code == 404 and "location" not in resp.headers


def test_cross_site_simple_posts_are_refused(adv):
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=z"):
        assert_clean_error(post(adv, REQUEST, headers={"Content-Type": content_type}), 415, "Content-Type")


def test_docs_pages_are_served_without_a_cdn(adv):
    for path in ("/docs", "/redoc"):
        page = httpx.get(adv.url + path).text
        assets = re.findall(r'(?:src|href)="([^"]+)"', page)
        assert assets and all(a.startswith("/docs/assets/") for a in assets), assets
        for asset in assets:
            assert httpx.get(adv.url + asset).status_code == 200, asset
    assert httpx.get(adv.url + "/docs/oauth2-redirect").status_code == 404


def test_docs_follow_the_auth_health_metrics_rule(servers):
    term = term_ready(servers)
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/assets/swagger-ui.css", "/health", "/metrics"):
        assert httpx.get(term.url + path).status_code == 401, path
        assert httpx.get(term.url + path, headers=AUTH).status_code == 200, path


# --------------------------------------------------------------------------- D5: SIGTERM with stalled clients


def test_d5_sigterm_aborts_stalled_clients_answers_the_rest_and_exits_in_time(servers):
    term = term_ready(servers)
    holds = servers["holds"]
    stalled_upload = connect(term.port)
    stalled_upload.sendall(head("/v1/systemone", term.port, content_length=1000, extra=AUTH) + b'{"model":')
    silent_bulk = connect(term.port)
    silent_bulk.sendall(head("/v1/systemone/bulk", term.port, content_type="application/x-ndjson", extra=AUTH))
    with ThreadPoolExecutor(2) as pool:
        progressing = pool.submit(post, term, held("p1"), AUTH)
        abandoned = pool.submit(post, term, held("p2"), AUTH)
        wait(lambda: metric(term, "clef_in_flight", headers=AUTH) == 2, 30, "two requests in the engine")
        term.proc.send_signal(signal.SIGTERM)
        status, _, text = read_response(stalled_upload, 10)   # stalled upload: 503 JSON at once
        assert status == 503 and b"shutting down" in text
        status, _, text = read_response(silent_bulk, 10)      # a bulk stream that never sent a byte: the same
        assert status == 503 and b"shutting down" in text
        threading.Timer(0.5, lambda: (holds / "p1").touch()).start()
        assert progressing.result(timeout=30).status_code == 200          # progressing: answered
        late = abandoned.result(timeout=30)                               # never finishes: 503 at the timeout
        assert_clean_error(late, 503, "--shutdown-timeout")
        code = term.proc.wait(timeout=30)
    assert code == 0
    log = term.log()
    # the drain waited its whole --shutdown-timeout 5 for the one request still open, then abandoned it
    assert "shutdown timeout (5 s): 1 open request(s) are answered 503 and abandoned" in log
    assert "Traceback" not in log and "ASGI" not in log and " ERROR " not in log


def test_a_second_sigterm_answers_open_requests_and_exits_at_once_without_a_traceback(tiny_release, tmp_path):
    """Process managers, ``timeout`` and impatient people signal twice: the second SIGTERM answers
    what is still open 503 (naming it), closes the backend and exits, without the drain's wait and
    without uvicorn's cancelled-lifespan traceback."""
    holds = tmp_path / "holds"
    holds.mkdir()
    server = LiveServer(["--model", str(tiny_release), "--backend", "reference", "--shutdown-timeout", "60"],
                        env={"CLEF_VLLM_FAULTS": f"instant,hold_dir={holds}"}).wait_ready()
    try:
        with ThreadPoolExecutor(1) as pool:
            stuck = pool.submit(post, server, held("twice"))
            wait(lambda: metric(server, "clef_in_flight") == 1, 30, "the request in the engine")
            server.proc.send_signal(signal.SIGTERM)
            wait(lambda: "graceful shutdown" in server.log(), 10, "the first signal")
            server.proc.send_signal(signal.SIGTERM)
            assert_clean_error(stuck.result(timeout=30), 503, "a second SIGTERM")
            code = server.proc.wait(timeout=30)
    finally:
        server.stop()
    assert code == 0
    log = server.log()
    # abandoned by the second signal, not by the drain's 60 s timeout
    assert "SIGTERM again: 1 open request(s) are answered 503 and abandoned" in log
    assert "shutdown timeout" not in log
    assert "SIGTERM again: exiting now" in log
    assert "Traceback" not in log and "CancelledError" not in log and " ERROR " not in log, log[-3000:]


# --------------------------------------------------------------------------- finally


def test_nothing_was_a_server_error_and_nothing_was_a_traceback(adv, servers):
    statuses = httpx.get(adv.url + "/metrics").text
    # the one 5xx a client can cause is the documented 503 of a connection past --max-connections
    assert not re.search(r'clef_requests_total\{(?![^}]*reason="connections")[^}]*status="5\d\d"', statuses), statuses
    assert not re.search(r'clef_bulk_records_total\{[^}]*status="5\d\d"', statuses)
    log = adv.log()
    assert "Traceback" not in log and " ERROR " not in log and "internal error" not in log
    assert adv.proc.poll() is None
