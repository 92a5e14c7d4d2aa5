"""The reference backend's state cache through ``clef-systemone`` (``--backend reference --state-cache on``):
reused state tokens reported in ``usage`` and ``/metrics``, answers equal to the same checkpoint's without the
cache (the offline API), and the vLLM-only sub-options refused."""

from __future__ import annotations

import httpx
import pytest

from clef_vllm import Clef
from clef_vllm.server.cli import API_KEY_ENV, main
from conftest import LiveServer
from support.server_calls import post


def test_the_reference_backend_state_cache_through_the_server(tiny_release, capsys, monkeypatch):
    """``clef-systemone --backend reference --state-cache on``: the second request about a long state reports its
    state's tokens in ``usage.cached_state_tokens`` and in ``/metrics`` as reused prompt tokens, with the
    answers of the same checkpoint without the cache (the offline API: the same backend in this process); the
    vLLM-only sub-options are refused for the reference backend."""
    import random

    words = "order invoice refund ticket outage payment account region cluster team".split()
    state = " ".join(random.Random(3).choice(words) for _ in range(1300))
    body = {"model": "m", "state": state, "questions": {"u": {"type": "noul", "instructions": "Urgent?"}}}
    on = LiveServer(["--model", str(tiny_release), "--backend", "reference", "--state-cache", "on",
                     "--dtype", "float32"]).wait_ready()
    try:
        first, second = (post(on, body).json() for _ in range(2))
        assert first["usage"]["cached_state_tokens"] == 0
        reused = second["usage"]["cached_state_tokens"]
        assert 1024 <= reused < second["usage"]["input_tokens"]
        metrics = httpx.get(on.url + "/metrics").text
        assert f'clef_prompt_tokens_total{{source="reused"}} {float(reused)}' in metrics
    finally:
        on.stop()
    with Clef(tiny_release, backend="reference", dtype="float32") as clef:     # what a server without the cache says
        plain = clef.systemone(body)
    assert abs(second["answers"]["u"]["noul"] - plain["answers"]["u"]["noul"]) < 1e-3
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tiny_release), "--backend", "reference", "--state-cache", "on", "--state-cache-match",
              "block"])
    assert exit_.value.code == 2 and "--state-cache-match" in capsys.readouterr().err
