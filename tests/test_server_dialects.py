"""``clef-systemone --dialect workers-ai`` (the hosted envelope): success and error envelopes, routing errors
in the envelope, and the server's ``--gc-freeze off`` (this server runs with it)."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import REQUEST, LiveServer
from support.server_calls import metrics_of, post

#: A valid 1x1 PNG: media pass validation (tests/test_media*.py), then this build's text-only 400.
PNG_1X1 = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


@pytest.fixture(scope="module")
def hosted(tiny_release, cache_dir):
    server = LiveServer(["--model", str(tiny_release), "--backend", "reference", "--dialect", "workers-ai",
                         "--gc-freeze", "off"]).wait_ready()
    yield server
    server.stop()


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


def test_hosted_dialect_envelope_for_routing_errors(hosted):
    resp = httpx.get(hosted.url + "/nope")
    assert resp.status_code == 404 and resp.json()["errors"][0]["code"] == 7000
    assert "x-request-id" in resp.headers and "server-timing" in resp.headers
