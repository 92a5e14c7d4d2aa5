"""``POST /v1/systemone/bulk`` on the shared live server: one NDJSON line per record, each answered like the
single endpoint, streamed while the body is still being sent. The bulk limits (a line over the size cap, the
concurrency bound, the stream limit) are in tests/test_server_limits.py and tests/test_server_ops.py."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import REQUEST
from support.server_calls import NDJSON, RawHttp, post
from test_server_api import PNG_1X1


@pytest.fixture(scope="module")
def live(live_server):
    return live_server


def test_bulk_answers_each_line_like_the_single_endpoint(live):
    lines = [json.dumps(REQUEST | {"model": "line-0"}), "this is not json", "",
             json.dumps({"model": "line-3", "state": "x", "questions": {}}),
             json.dumps(REQUEST | {"model": "line-4", "state": {"deep": [1, {"ü": None}]}}), "   ",
             json.dumps(REQUEST | {"images": ["data:image/png;base64,AAAA"]}),
             json.dumps(REQUEST | {"model": "odd\u2028line\u0085breaks"}, ensure_ascii=False),
             json.dumps(REQUEST | {"model": "line-8", "images": [PNG_1X1]})]          # an image: answered
    resp = httpx.post(live.url + "/v1/systemone/bulk", content=("\n".join(lines) + "\n").encode(), timeout=60,
                      headers={"X-Request-Id": "bulk-job-1", **NDJSON})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/x-ndjson")
    assert resp.headers["x-request-id"] == "bulk-job-1"
    out = [json.loads(line) for line in resp.text.splitlines()]   # U+2028/U+0085 stay escaped: one line each
    assert out[-1] == {"summary": {"records": 7, "ok": 4, "failed": 3, "aborted": None}}
    records = {o["index"]: o for o in out[:-1]}
    assert sorted(records) == [0, 1, 3, 4, 6, 7, 8]                # blank lines skipped, still counted
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
