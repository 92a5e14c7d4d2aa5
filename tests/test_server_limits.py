"""The request-size limits of ``clef-systemone`` on a server with ``--max-model-len 600 --max-body-bytes 8192``
(run without the fastapi-offline package): bodies and bulk lines over the byte cap, schemas over the token
budget, states truncated and counted; and the doc pages off when fastapi-offline is missing."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from conftest import REQUEST, LiveServer
from support.server_calls import NDJSON, assert_error, metric, post


@pytest.fixture(scope="module")
def limits(tiny_release, cache_dir, tmp_path_factory):
    nodocs = tmp_path_factory.mktemp("no-docs") / "fastapi_offline"     # this server runs without fastapi-offline
    nodocs.mkdir()
    (nodocs / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
    hide_docs = {"PYTHONPATH": os.pathsep.join(filter(None, [str(nodocs.parent), os.environ.get("PYTHONPATH")]))}
    server = LiveServer(["--model", str(tiny_release), "--backend", "reference", "--max-model-len", "600",
                         "--max-body-bytes", "8192"], env=hide_docs).wait_ready()
    yield server
    server.stop()


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

