"""clef-bench and clef-parity: request generation, statistics, parity math, and both tools
against a real ``clef-systemone`` on the tiny checkpoint (small runs, CPU)."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from clef_vllm.bench.bench_cli import main as bench_main
from clef_vllm.bench.bench_cli import parse_concurrency
from clef_vllm.bench.loadgen import (percentile, server_timing, server_total_ms, stage_medians, systemone_url,
                                     unwrap_envelope)
from clef_vllm.bench.parity import compare_runs, distribution, kl_divergence, total_variation
from clef_vllm.bench.parity_cli import main as parity_main
from clef_vllm.bench.targets import Answered, Condition
from clef_vllm.bench.workloads import (RequestFactory, StateWriter, build_variants,
                                       synthetic_parity_set)
from clef_vllm.schema.records import load_request_file
from clef_vllm.testing.server import free_port

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def hosted_server(tiny_release, cache_dir):
    """A second server: same checkpoint, Workers-AI dialect (hosted envelope, Gini confidence, strict limits)."""
    from conftest import LiveServer

    args = ["--model", str(tiny_release), "--backend", "reference", "--dialect", "workers-ai"]
    server = LiveServer(args).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_encoder(tiny_release):
    from clef_vllm.schema.encoding import RequestEncoder

    return RequestEncoder.from_pretrained(tiny_release)


@pytest.fixture(scope="module")
def tiny_short_tokens(tiny_encoder) -> int:
    """A short-request target the tiny tokenizer can meet (its BPE spends more tokens on the template)."""
    factory = RequestFactory(tiny_encoder)
    short = build_variants(["short"])[0]
    return max(factory.min_total_tokens(short), 400) + 100


def bench_script(name: str):
    """``bench/NAME.py`` as a module (the bench scripts are not a package; tests must not import them by name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"clef_bench_{name}", Path(__file__).resolve().parents[1]
                                                  / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


GOOD = {"model": "clef-flash", "state": "Checkout has been failing for every customer for the last hour.",
        "questions": {"urgent": {"type": "noul", "instructions": "Is this support request urgent?"},
                      "team": {"type": "choice", "instructions": "Which team?",
                               "criteria": {"technical": "Outages", "billing": "Payments"}},
                      "severity": {"type": "score", "criteria": ["None", "Minor", "Major", "Critical"]}}}


# --------------------------------------------------------------------------- workloads


@pytest.mark.parametrize("n", [0, 1, 7, 50, 333, 2000])
def test_state_writer_hits_exact_token_counts(tiny_encoder, n):
    text = StateWriter(tiny_encoder).text(n, random.Random(n))
    assert len(tiny_encoder.tokenize(text)) == n


def test_qwen_tokenizer_workloads_have_exact_totals(qwen_tokenizer_dir):
    from clef_vllm.schema.encoding import RequestEncoder

    factory = RequestFactory(RequestEncoder.from_pretrained(qwen_tokenizer_dir), seed=3)
    short, long4k, long16k = build_variants(["short", "long"])
    assert factory.min_total_tokens(short) < short.total_tokens  # default short target leaves room for a state
    assert {r.expected_tokens for r in factory.requests(short, 12)} == {short.total_tokens}
    assert [r.expected_tokens for r in factory.requests(long4k, 2)] == [4096, 4096]
    assert factory.make(long16k, 0).expected_tokens == 16384
    req = factory.make(short, 5)
    assert [len(q) for q in req.body["questions"]] and [q["type"] for q in req.body["questions"].values()] == \
        ["noul", "choice", "score"]


def test_fanout_variants_share_one_state(tiny_encoder):
    factory = RequestFactory(tiny_encoder)
    one, eight = build_variants(["fanout"], fanout_state_tokens=300, fanout_questions=[1, 8])
    a, b = factory.make(one, 2), factory.make(eight, 2)
    assert a.body["state"] == b.body["state"]
    assert len(tiny_encoder.tokenize(a.body["state"])) == 300
    assert (a.questions, b.questions) == (1, 8)
    assert b.expected_tokens > a.expected_tokens
    types = [q["type"] for q in b.body["questions"].values()]
    assert types[:3] == ["noul", "choice", "score"] and len(set(b.body["questions"])) == 8


def test_shared_state_variants_ask_new_questions_about_one_state(tiny_encoder):
    factory = RequestFactory(tiny_encoder)
    variants = build_variants(["shared-state"], shared_states=((300, 5), (600, 3)))
    assert [(v.name, v.requests) for v in variants] == [("shared-300", 5), ("shared-600", 3)]
    reqs = factory.requests(variants[0], 5)
    assert len({json.dumps(r.body["state"]) for r in reqs}) == 1
    assert len({json.dumps(r.body["questions"], sort_keys=True) for r in reqs}) == 5
    assert len(tiny_encoder.tokenize(reqs[0].body["state"])) == 300
    assert RequestFactory(tiny_encoder).make(variants[0], 3).body == reqs[3].body           # deterministic


def test_multi_state_variants_go_round_robin_and_warm_up_elsewhere(tiny_encoder):
    """TOKENSxREQUESTSxSTATES: request i asks about state i mod STATES; warm-up requests use states of their
    own (so warming up never caches a measured state); the one-state variant keeps its one state."""
    from clef_vllm.bench.bench_cli import _shared_states
    from clef_vllm.bench.workloads import WARM_START

    spec = _shared_states("300x5,200x6x3")
    assert spec == [(300, 5), (200, 6, 3)]
    one, multi = build_variants(["shared-state"], shared_states=spec)
    assert (multi.name, multi.requests, multi.states) == ("shared-200-3s", 6, 3) and multi.describe()["states"] == 3
    factory = RequestFactory(tiny_encoder)
    states = [r.body["state"] for r in factory.requests(multi, 6)]
    assert states[:3] == states[3:] and len(set(states)) == 3
    warm = [r.body["state"] for r in factory.requests(multi, 2, start=WARM_START)]
    assert len(set(warm)) == 2 and not set(warm) & set(states)
    assert factory.make(one, 0).body["state"] == factory.make(one, WARM_START).body["state"]
    for bad in ("300", "300x0", "1x2x3x4", "ax2"):
        with pytest.raises(Exception, match="TOKENSxREQUESTS"):
            _shared_states(bad)


def test_requests_are_deterministic_and_prefix_stable(tiny_encoder):
    v = build_variants(["short"], short_tokens=600)[0]
    a = RequestFactory(tiny_encoder, seed=1).requests(v, 6)
    b = RequestFactory(tiny_encoder, seed=1).requests(v, 3)
    c = RequestFactory(tiny_encoder, seed=2).requests(v, 3)
    assert [r.payload for r in a[:3]] == [r.payload for r in b]
    assert [r.payload for r in b] != [r.payload for r in c]
    assert len({r.payload for r in a}) == 6


def test_mixed_workload_shares(tiny_encoder):
    factory = RequestFactory(tiny_encoder)
    (mixed,) = build_variants(["mixed"], short_tokens=600, long_tokens=[700, 900])
    sizes = [factory.make(mixed, i).expected_tokens for i in range(200)]
    share = {n: sizes.count(n) / len(sizes) for n in (700, 900)}
    assert 0.15 < share[700] < 0.35 and 0.15 < share[900] < 0.35
    assert 0.4 < sizes.count(600) / len(sizes) < 0.6


def test_request_file_keeps_only_request_keys(tmp_path):
    path = _write_jsonl(tmp_path / "r.jsonl", [
        {**GOOD, "id": "rec-1", "answer": "technical", "source": "x"},
        {"request": {"state": "hi", "questions": GOOD["questions"]}, "id": 7},
        {"state": "no model", "questions": GOOD["questions"]},
    ])
    records = load_request_file(path)
    assert [r.label for r in records] == ["rec-1", "7", "line3"]
    assert records[0].answer is None  # only a dict {question_id: option} is an answer key
    assert set(records[0].body) == {"model", "state", "questions"}
    assert records[1].body["model"] == records[2].body["model"] == "clef-flash"
    assert len(load_request_file(path, limit=2)) == 2
    (tmp_path / "bad.jsonl").write_text("{}\nnot json\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_request_file(tmp_path / "bad.jsonl")


def test_synthetic_parity_set_is_varied_and_deterministic():
    a, b = synthetic_parity_set(40, seed=5), synthetic_parity_set(40, seed=5)
    assert a == b and a != synthetic_parity_set(40, seed=6)
    types = {q["type"] for body in a for q in body["questions"].values()}
    assert types == {"noul", "choice", "score"}
    choice_ids = [list(q["criteria"]) for body in a for q in body["questions"].values() if q["type"] == "choice"]
    assert any(ids != sorted(ids) for ids in choice_ids)  # wire order is not the encoded order
    assert any(not isinstance(body["state"], str) for body in a)
    shared = synthetic_parity_set(40, seed=5, states=8)
    assert [body["state"] for body in shared] == [a[i % 8]["state"] for i in range(40)]   # states repeat
    assert [body["questions"] for body in shared] == [body["questions"] for body in a]   # questions do not


# --------------------------------------------------------------------------- small helpers


def test_parse_concurrency_and_helpers():
    assert parse_concurrency(["1,4,16"]) == ([1, 4, 16], {})
    assert parse_concurrency(["1,4", "long=1,2", "fanout-64q=1"]) == ([1, 4], {"long": [1, 2], "fanout-64q": [1]})
    assert parse_concurrency(["long=2"]) == ([1, 4, 16, 64], {"long": [2]})
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([], 50) is None
    assert percentile(list(range(101)), 90) == 90
    assert server_total_ms("total;dur=12.5") == 12.5 and server_total_ms("db;dur=3, total;dur=7") == 7.0
    assert server_total_ms(None) is None
    assert server_timing("parse;dur=0.21, encode;dur=1.5, engine;dur=40.25, total;dur=43") == \
        {"parse": 0.21, "encode": 1.5, "engine": 40.25, "total": 43.0}
    assert server_timing(None) == {} and server_timing("garbage") == {}
    assert stage_medians([{"engine": 10.0, "total": 12.0}, {"engine": 30.0, "total": 31.0}, {"total": 5.0}]) == \
        {"engine": 20.0, "total": 12.0}
    from clef_vllm.bench.report import stages_table

    assert stages_table({"points": [{"variant": "short", "concurrency": 1}]}) is None    # no stages: no table
    text = stages_table({"points": [{"variant": "short", "concurrency": 1,
                                     "server_stages_p50_ms": {"total": 33.0, "engine": 29.2, "encode": 0.9}}]})
    assert text.splitlines()[1].split() == ["variant", "c", "encode", "engine", "total"]   # in request order
    assert text.splitlines()[3].split() == ["short", "1", "0.9", "29.2", "33.0"]
    assert systemone_url("http://h:1/") == systemone_url("http://h:1/v1/systemone") == "http://h:1/v1/systemone"
    assert unwrap_envelope({"result": {"answers": {}}, "success": True}) == {"answers": {}}


def test_bench_modules_import_without_torch_or_vllm():
    code = ("import sys, clef_vllm.bench.bench_cli, clef_vllm.bench.parity_cli, clef_vllm.bench.raw_vllm; "
            "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_raw_vllm_engine_settings(tiny_release, tiny_repacked, tmp_path):
    from clef_vllm.bench.raw_vllm import raw_engine_kwargs
    from clef_vllm.model.release import clef_flash_config, write_config_only_checkpoint

    release = raw_engine_kwargs(tiny_release, max_model_len=4096)
    repacked = raw_engine_kwargs(tiny_repacked, extra={"max_num_seqs": 7})
    for kw in (release, repacked):
        assert kw["runner"] == "pooling" and kw["convert"] == "embed"
        assert kw["enable_prefix_caching"] is False and kw["gdn_prefill_backend"] == "triton"
        assert kw["pooler_config"] == {"seq_pooling_type": "LAST"}
        assert "additional_config" not in kw  # no head options, and so no batch wait (docs/bench.md)
        assert kw["scheduler_cls"] == "clef_vllm.worker.scheduler.ClefScheduler"   # the scheduler's fixes stay
    # The release declares Qwen3_5ForConditionalGeneration: stock class, text only, real weights.
    assert "hf_overrides" not in release and release["language_model_only"] is True
    assert release["load_format"] == "auto" and release["max_model_len"] == 4096
    # Repacked (ClefFlashForDecision, int8 tables): stock text class on dummy weights.
    assert repacked["hf_overrides"] == {"architectures": ["Qwen3_5ForCausalLM"]}
    assert repacked["load_format"] == "dummy" and repacked["max_num_seqs"] == 7
    assert "language_model_only" not in repacked
    assert raw_engine_kwargs(tiny_release, arch="Qwen3_5ForCausalLM")["hf_overrides"] == {
        "architectures": ["Qwen3_5ForCausalLM"]}
    # A 9B-shaped config-only folder: nothing to load, so dummy weights.
    config_only = raw_engine_kwargs(write_config_only_checkpoint(tmp_path / "9b", tiny_release))
    assert config_only["load_format"] == "dummy" and config_only["language_model_only"] is True
    # ... and a quantized config-only folder gets the dummy weights whose scales are tame
    quantized = dict(clef_flash_config(), quantization_config={"quant_method": "compressed-tensors"})
    hybrid = write_config_only_checkpoint(tmp_path / "9b-hybrid", tiny_release, config=quantized)
    assert raw_engine_kwargs(hybrid)["load_format"] == "clef-dummy"


# --------------------------------------------------------------------------- parity math


def _noul(p):
    return {"type": "noul", "noul": p}


def _choice(probs):
    return {"type": "choice", "choice": max(probs, key=probs.get), "confidence": max(probs.values()),
            "probabilities": probs}


def _score(probs):
    return {"type": "score", "score": sum(i * p for i, p in enumerate(probs)), "confidence": max(probs),
            "legend": {str(i): str(i) for i in range(len(probs))},
            "probabilities": {str(i): p for i, p in enumerate(probs)}}


def _ok(answers, tokens=100):
    return Answered("200", body={"model": "m", "answers": answers, "usage": {"input_tokens": tokens}})


def test_distribution_tv_kl():
    d = distribution(_choice({"b": 0.7, "a": 0.2, "c": 0.1}))
    assert d.top == "b" and d.labels == ["b", "a", "c"] and d.margin == pytest.approx(0.5)
    assert distribution(_noul(0.5)).top == "true" and distribution(_noul(0.4999)).top == "false"
    assert distribution(_score([0.4, 0.4, 0.2])).top == "0"  # ties: first level
    assert total_variation([0.5, 0.5], [0.7, 0.3]) == pytest.approx(0.2)
    assert kl_divergence([0.5, 0.5], [0.5, 0.5]) == 0
    assert kl_divergence([1.0, 0.0], [0.0, 1.0]) > 10  # floored, finite
    assert kl_divergence([0.5, 0.5], [0.9, 0.1]) == pytest.approx(
        0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), rel=1e-4)


def test_compare_runs_counts_flips_errors_and_tokens():
    a = [_ok({"n": _noul(0.9), "c": _choice({"x": 0.55, "y": 0.45}), "s": _score([0.1, 0.2, 0.7])}),
         _ok({"n": _noul(0.2)}, tokens=50),
         Answered("422", error="bad"),
         Answered("413", error="too long")]
    b = [_ok({"n": _noul(0.88), "c": _choice({"y": 0.52, "x": 0.48}), "s": _score([0.1, 0.2, 0.7])}),
         _ok({"n": _noul(0.2)}, tokens=51),
         Answered("422", error="bad"),
         _ok({"n": _noul(0.5)})]
    r = compare_runs(["r0", "r1", "r2", "r3"], a, b)
    assert r["requests_compared"] == 2
    assert r["status_pairs_not_compared"] == {"413/200": 1, "422/422": 1}
    assert r["problems"][0]["label"] == "r3"  # the status disagreement is listed, the shared 422 is not
    assert r["input_token_mismatches"] == 1 and r["input_token_mismatch_examples"][0]["label"] == "r1"
    assert r["per_type"]["noul"]["questions"] == 2 and r["per_type"]["noul"]["flips"] == 0
    assert r["per_type"]["noul"]["max_abs_dp"] == pytest.approx(0.02)
    choice = r["per_type"]["choice"]
    assert choice["flips"] == 1 and choice["top1_agreement"] == 0 and choice["mean_tv"] == pytest.approx(0.07)
    assert r["per_type"]["score"]["mean_tv"] == 0 and r["per_type"]["score"]["mean_abs_d_score"] == 0
    assert r["overall"]["questions"] == 4 and r["overall"]["top1_agreement"] == pytest.approx(0.75)
    (flip,) = r["flips"]
    assert (flip["label"], flip["question"], flip["a_top"], flip["b_top"]) == ("r0", "c", "x", "y")
    assert flip["a_margin"] == pytest.approx(0.1) and flip["b_margin"] == pytest.approx(0.04)
    assert r["cached_requests"] == 0 and r["overall_cached"]["questions"] == 0


def test_compare_runs_splits_the_questions_answered_from_a_cached_state():
    from clef_vllm.bench.report import parity_markdown

    a = [_ok({"n": _noul(0.9)}), _ok({"n": _noul(0.3)}), _ok({"n": _noul(0.6)})]
    b = [_ok({"n": _noul(0.9)}), _ok({"n": _noul(0.7)}), _ok({"n": _noul(0.61)})]
    b[1].body["usage"]["cached_state_tokens"] = 1056
    b[2].body["usage"]["cached_state_tokens"] = 528
    r = compare_runs(["r0", "r1", "r2"], a, b)
    assert r["cached_state_tokens"] == {"a": 0, "b": 1584} and r["cached_requests"] == 2
    assert r["overall_cached"]["questions"] == 2 and r["overall_cached"]["flips"] == 1
    assert r["overall_uncached"] == {**r["overall_uncached"], "questions": 1, "flips": 0, "max_abs_dp": 0}
    receipt = {"a": {"spec": "http://a"}, "b": {"spec": "http://b"}, "comparison": r,
               "request_set": {"source": "s", "requests": 3, "sha256": "0" * 64,
                               "questions": {"total": 3, "noul": 3, "choice": 0, "score": 0}},
               "conditions": {"main": {"concurrency": 8, "order": "request"}}}
    assert "Answered from a cached state: 2 requests (cached state tokens A 0, B 1584)" in parity_markdown(receipt)


def test_accuracy_against_answer_keys():
    from clef_vllm.bench.parity import accuracy

    bodies = [{"questions": {"n": {"type": "noul"}, "c": {"type": "choice"}}}, {"questions": {"s": {"type": "score"}}},
              {"questions": {"n": {"type": "noul"}}}]
    run = [_ok({"n": _noul(0.9), "c": _choice({"x": 0.3, "y": 0.7})}), _ok({"s": _score([0.2, 0.8])}),
           Answered("503", error="busy")]
    acc = accuracy(run, bodies, [{"n": "true", "c": "x"}, {"s": "1"}, {"n": "false"}])
    assert acc["per_type"]["noul"] == {"questions": 2, "correct": 1, "accuracy": 0.5}
    assert acc["per_type"]["choice"]["correct"] == 0 and acc["per_type"]["score"]["accuracy"] == 1.0
    assert acc["overall"] == {"questions": 4, "correct": 2, "accuracy": 0.5} and acc["unanswered"] == 1


def test_condition_orders():
    assert Condition("m", 4).indices(5) == [0, 1, 2, 3, 4]
    shuffled = Condition("n", 1, "shuffled", seed=3).indices(50)
    assert sorted(shuffled) == list(range(50)) and shuffled != list(range(50))
    assert shuffled == Condition("n", 1, "shuffled", seed=3).indices(50)


# --------------------------------------------------------------------------- against a live server


def _bench(argv, out: Path) -> tuple[int, dict]:
    rc = bench_main([*argv, "-o", str(out), "--no-progress"])
    return rc, json.loads(out.read_text())


def _check_point(p: dict) -> None:
    assert p["ok"] == p["sent"] == p["requests"] and p["errors"] == {} and p["unexpected_status"] == 0
    assert p["req_per_s"] > 0 and p["input_tok_per_s"] > 0 and p["questions_per_s"] > 0 and p["duration_s"] > 0
    lat = p["latency_ms"]
    assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert p["server_ms"]["p50"] <= lat["p50"]  # our server reports Server-Timing; it excludes the network
    stages = p["server_stages_p50_ms"]           # and says where its time went
    assert {"parse", "encode", "engine", "total"} <= set(stages) and stages["engine"] <= stages["total"]
    tokens = p["input_tokens"]
    assert tokens["checked"] == p["ok"] and tokens["mismatches"] == 0
    assert tokens["total_reported"] == pytest.approx(p["input_tok_per_s"] * p["duration_s"], rel=1e-3)
    assert tokens["cached"] == 0 and tokens["requests_with_hits"] == 0  # the reference backend has no state cache


def test_bench_short_and_fanout_against_live_server(live_server, tiny_release, tiny_short_tokens, tmp_path, capsys):
    rc, res = _bench([live_server.url, "--tokenizer", str(tiny_release), "--workload", "short,fanout",
                      "--short-tokens", str(tiny_short_tokens), "--fanout-tokens", "64", "--fanout-questions", "1,3",
                      "--concurrency", "1,2", "fanout=2", "-n", "4", "--warmup", "1", "--wait-ready", "30",
                      "--label", "ci", "--fail-on-error"], tmp_path / "bench.json")
    assert rc == 0
    assert res["schema"] == "clef-bench/1" and res["mode"] == "http" and res["label"] == "ci"
    assert res["target"]["url"] == live_server.url + "/v1/systemone"
    assert res["server"]["data"][0]["backend"] == "reference"
    assert [(p["variant"], p["concurrency"]) for p in res["points"]] == [
        ("short", 1), ("short", 2), ("fanout-1q", 2), ("fanout-3q", 2)]
    for p in res["points"]:
        _check_point(p)
    short = res["points"][0]
    assert short["input_tokens"]["mean_expected"] == tiny_short_tokens
    assert short["input_tokens"]["total_reported"] == 4 * tiny_short_tokens
    assert [v["questions"] for v in res["variants"]] == [3, 1, 3]
    assert res["complete"] is True and res["finished_utc"]
    assert (tmp_path / "bench.txt").read_text().startswith("clef-bench http")
    table = capsys.readouterr().out
    assert "p99 ms" in table and "fanout-3q" in table and "MISMATCH" not in table
    # and where the server's time went, per point (the reference backend reports its micro-batch stages too)
    stages = table[table.index("server time per stage"):].splitlines()
    assert stages[1].split()[:4] == ["variant", "c", "parse", "queue"] and "engine" in stages[1]
    assert len(stages) == 3 + len(res["points"]) and stages[3].split()[:2] == ["short", "1"]
    assert "server time per stage" in (tmp_path / "bench.txt").read_text()


def test_bench_tokenizer_demo_is_the_local_demo_checkpoint(live_server, tiny_short_tokens, tmp_path, capsys):
    """--tokenizer demo means the demo checkpoint (its tokenizer is the tiny one the live server uses);
    a name that is not a folder fails at once, naming the flag, and never reaches for a model hub."""
    from clef_vllm.model.demo import demo_checkpoint

    rc, res = _bench([live_server.url, "--tokenizer", "demo", "--short-tokens", str(tiny_short_tokens), "-c", "1",
                      "-n", "2", "--warmup", "0", "--fail-on-error"], tmp_path / "demo.json")
    assert rc == 0 and res["points"][0]["input_tokens"]["mismatches"] == 0
    assert res["settings"]["tokenizer"] == str(demo_checkpoint())
    assert f"demo checkpoint (tiny, random weights): {demo_checkpoint()}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        bench_main([live_server.url, "--tokenizer", "no-such-checkpoint", "-o", str(tmp_path / "x.json")])
    assert exit_.value.code == 2
    assert "--tokenizer no-such-checkpoint: no such folder" in capsys.readouterr().err


def test_bench_detects_token_count_mismatch(live_server, tiny_release, tiny_short_tokens, tmp_path):
    # The client believes the server cuts requests at 8 tokens fewer than it does: every count differs.
    rc, res = _bench([live_server.url, "--tokenizer", str(tiny_release), "--short-tokens", str(tiny_short_tokens),
                      "--max-model-len", str(tiny_short_tokens - 8), "-c", "1", "-n", "3", "--warmup", "0",
                      "--fail-on-error"], tmp_path / "mismatch.json")
    assert rc == 1
    tokens = res["points"][0]["input_tokens"]
    assert tokens["checked"] == 3 and tokens["mismatches"] == 3
    assert tokens["mismatch_examples"][0] == {"request": "short#0", "expected": tiny_short_tokens - 8,
                                              "reported": tiny_short_tokens}


def test_bench_request_file_counts_errors_by_status(live_server, tiny_release, tmp_path):
    path = _write_jsonl(tmp_path / "file.jsonl", [
        {**GOOD, "id": "ok-1", "answer": "technical"},
        {**GOOD, "id": "empty-choice", "questions": {"team": {"type": "choice", "criteria": {}}}},
        {**GOOD, "id": "bad-type", "questions": {"q": {"type": "ranking"}}},
        {**GOOD, "id": "ok-2", "state": {"ticket": 1}},
    ])
    rc, res = _bench([live_server.url, "--tokenizer", str(tiny_release), "--workload", "none", "--requests", str(path),
                      "-c", "2", "--warmup", "0"], tmp_path / "file.json")
    assert rc == 0
    (p,) = res["points"]
    assert p["variant"] == "file" and (p["requests"], p["ok"]) == (4, 2)
    assert p["errors"] == {"422": 2} and p["unexpected_status"] == 0  # the encoder predicted both refusals
    assert p["input_tokens"]["checked"] == 2 and p["input_tokens"]["mismatches"] == 0
    assert {e["request"] for e in p["error_examples"]} == {"empty-choice", "bad-type"}


def test_bench_counts_connection_errors(tiny_release, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on
    rc, res = _bench([url, "--tokenizer", str(tiny_release), "--short-tokens", "600", "-c", "1", "-n", "2",
                      "--warmup", "0", "--timeout", "5", "--fail-on-error"], tmp_path / "dead.json")
    assert rc == 1
    p = res["points"][0]
    assert p["errors"] == {"connect_error": 2} and p["ok"] == 0 and p["latency_ms"] is None


def test_sender_reports_timeouts_and_bad_bodies():
    """The load generator's HTTP client: a server that never answers is a timeout, one that answers
    200 with the wrong number of answers is a bad_response, and neither raises."""
    import asyncio

    from clef_vllm.bench.loadgen import HttpSender
    from clef_vllm.bench.workloads import BenchRequest

    async def scenario():
        async def silent(reader, writer):
            await asyncio.sleep(5)
            writer.close()

        async def wrong(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            body = b'{"answers": {"a": {}}}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nserver-timing: total;dur=7.5\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            writer.close()

        req = BenchRequest("short", {}, b"{}", 2, None, label="x")
        out = []
        for handler, timeout in ((silent, 0.5), (wrong, 5.0)):
            server = await asyncio.start_server(handler, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            sender = HttpSender(f"http://127.0.0.1:{port}", concurrency=2, timeout=timeout)
            out.append(await sender.send(req))
            await sender.aclose()
            server.close()
        return out

    timed_out, bad = asyncio.run(scenario())
    assert timed_out.status == "timeout" and 0.4 < timed_out.latency_s < 3
    assert bad.status == "bad_response" and "1 answers for 2 questions" in bad.error and bad.server_ms == 7.5


def test_unique_per_point_gives_every_point_its_own_states(tiny_encoder):
    """--unique-per-point: no request state repeats across concurrency points or fan-out variants (a state
    cache would otherwise answer the later points from the earlier ones); shared-state variants keep theirs."""
    from clef_vllm.bench.bench_cli import build_parser, make_plan

    argv = ["http://x", "--workload", "short,fanout,shared-state", "--short-tokens", "700", "--fanout-tokens", "64",
            "--fanout-questions", "1,3",
            "--shared-states", "64x3", "-c", "1,2", "-n", "3"]
    factory = RequestFactory(tiny_encoder)
    plain = make_plan(build_parser().parse_args(argv), factory, lambda _: None)
    assert plain[0].point_requests(1)[0].body == plain[0].point_requests(2)[0].body   # without: points repeat

    plan = make_plan(build_parser().parse_args([*argv, "--unique-per-point"]), factory, lambda _: None)
    states = {}
    for item in plan:
        for c in (1, 2):
            reqs = item.point_requests(c)
            assert len(reqs) == 3
            states[item.name, c] = [r.body["state"] for r in reqs]
    unique = [s for (name, _), ss in states.items() if not name.startswith("shared") for s in ss]
    assert len(unique) == len(set(unique)) == 2 * 3 * 3       # short, fanout-1q, fanout-3q at two points
    assert len({s for (name, _), ss in states.items() if name == "shared-64" for s in ss}) == 1


def test_point_counts_state_cache_hits():
    """usage.cached_state_tokens is summed per point, as a share of the reported tokens, and shown in the table."""
    from clef_vllm.bench.loadgen import Outcome, summarize_point
    from clef_vllm.bench.report import bench_row
    from clef_vllm.bench.workloads import BenchRequest

    reqs = [BenchRequest("shared-4k", {}, b"{}", 3, 1000, label=f"r{i}") for i in range(4)]
    outs = [Outcome("200", 0.1, input_tokens=1000, cached_tokens=c) for c in (0, 864, 864, None)]
    p = summarize_point("shared-4k", 4, reqs, outs, 1.0)
    assert p["input_tokens"]["cached"] == 1728 and p["input_tokens"]["cached_share"] == 0.432
    assert p["input_tokens"]["requests_with_hits"] == 2
    assert bench_row(p)[-1] == "1000 ok, 43% cached"
    none = summarize_point("short", 1, reqs[:1], outs[:1], 1.0)
    assert none["input_tokens"]["cached"] == 0 and bench_row(none)[-1] == "1000 ok"


def test_bench_compare_mode(tmp_path, capsys):
    def result(mode, tok_s, p50):
        point = {"variant": "short", "concurrency": 4, "input_tok_per_s": tok_s, "req_per_s": tok_s / 300,
                 "latency_ms": {"p50": p50}, "errors": {}}
        return {"mode": mode, "target": {}, "points": [point, {**point, "variant": "long-4k"}]}

    base, res = tmp_path / "raw.json", tmp_path / "server.json"
    base.write_text(json.dumps(result("raw-vllm", 40000.0, 10.0)))
    res.write_text(json.dumps({**result("http", 30000.0, 12.5), "points": result("http", 30000.0, 12.5)["points"][:1]}))
    assert bench_main(["--compare", str(base), str(res), "-o", str(tmp_path / "cmp.json")]) == 0
    (row,) = json.loads((tmp_path / "cmp.json").read_text())["rows"]
    assert row["throughput_ratio"] == 0.75 and row["p50_ratio"] == 1.25
    out = capsys.readouterr().out
    assert "server vs baseline raw vLLM" in out and "0.750" in out


def _flips_are_near_ties(section: dict) -> None:
    """Batch composition may flip a near-tie, never a clear decision: every flip's margin on the
    reference side is within the largest probability change seen (x2 for the two options moving)."""
    limit = 2 * section["overall"]["max_abs_dp"] + 1e-4
    assert all(f["a_margin"] <= limit for f in section["flips"]), (limit, section["flips"])
    assert section["overall"]["top1_agreement"] >= 0.9


def test_parity_server_vs_offline_reference(live_server, tiny_release, tmp_path, capsys):
    # Main pass serial on both sides: the server and the offline API run the same code on batches of
    # one, so the answers are identical. The noise floor re-runs the server 4 at a time, shuffled:
    # the micro-batcher pads them together, which moves probabilities a little.
    receipt_path = tmp_path / "parity.json"
    rc = parity_main([live_server.url, f"reference:{tiny_release}", "--synthetic", "12",
                      "--synthetic-max-words", "120", "--device", "cpu", "-c", "1", "--noise-floor", "a",
                      "--noise-concurrency", "4", "--wait-ready", "30",
                      "-o", str(receipt_path), "--no-progress", "--fail-below", "1.0"])
    assert rc == 0
    receipt = json.loads(receipt_path.read_text())
    assert receipt["schema"] == "clef-parity/1"
    assert receipt["a"]["kind"] == "http" and receipt["b"]["kind"] == "offline"
    assert receipt["request_set"]["requests"] == 12 and len(receipt["request_set"]["sha256"]) == 64
    cmp_ = receipt["comparison"]
    assert cmp_["requests_compared"] == 12 and cmp_["input_token_mismatches"] == 0 and cmp_["problems"] == []
    overall = cmp_["overall"]
    assert overall["questions"] == receipt["request_set"]["questions"]["total"]
    assert overall["top1_agreement"] == 1.0 and cmp_["flips"] == []
    assert overall["max_abs_dp"] == 0 and overall["mean_tv"] == 0 and overall["mean_kl"] == 0
    for t in ("noul", "choice", "score"):
        assert cmp_["per_type"][t]["questions"] == receipt["request_set"]["questions"][t]
    noise = receipt["noise_floor"]["A"]
    assert noise["condition"] == {"name": "noise", "concurrency": 4, "order": "shuffled", "seed": 0}
    assert receipt["conditions"]["main"] == {"name": "main", "concurrency": 1, "order": "request"}
    nf = noise["comparison"]
    assert nf["overall"]["questions"] == overall["questions"] and nf["requests_compared"] == 12
    assert nf["overall"]["max_abs_dp"] < 0.02 and nf["overall"]["mean_tv"] < 0.005
    _flips_are_near_ties(nf)
    summary = receipt_path.with_suffix(".md").read_text()
    assert "| A vs B | overall |" in summary and "| noise A | overall |" in summary and "No flips" in summary
    assert "the noise floor" in summary
    assert "top-1" in capsys.readouterr().out


def test_parity_offline_against_itself_from_file(tiny_release, tmp_path):
    path = _write_jsonl(tmp_path / "held_out.jsonl", [
        {**GOOD, "id": "a", "answer": {"team": "technical", "urgent": "true"}, "source": "test"},
        {**GOOD, "id": "b", "state": {"invoice": {"total": 1250.0, "status": "overdue"}}},
        {**GOOD, "id": "c", "questions": {"team": {"type": "choice", "criteria": {}}}},  # refused by both
    ])
    out = tmp_path / "self.json"
    rc = parity_main([f"reference:{tiny_release}", f"reference:{tiny_release}", "--requests", str(path),
                      "--device", "cpu", "-c", "2", "--noise-floor", "none", "-o", str(out),
                      "--summary", str(tmp_path / "s.md"), "--no-progress"])
    assert rc == 0
    receipt = json.loads(out.read_text())
    cmp_ = receipt["comparison"]
    assert receipt["request_set"]["source"].startswith("file") and receipt["request_set"]["synthetic"] == 0
    assert cmp_["status_pairs_not_compared"] == {"422/422": 1} and cmp_["requests_compared"] == 2
    assert cmp_["overall"]["questions"] == 6 and cmp_["overall"]["mean_tv"] == 0 and cmp_["overall"]["max_abs_dp"] == 0
    assert receipt["noise_floor"] == {}
    acc = receipt["accuracy"]
    assert acc["A"] == acc["B"] and acc["A"]["overall"]["questions"] == 2 and acc["A"]["unanswered"] == 0
    assert (acc["A"]["per_type"]["choice"]["questions"], acc["A"]["per_type"]["noul"]["questions"]) == (1, 1)
    summary = (tmp_path / "s.md").read_text()
    assert summary.startswith("# clef-parity") and "Accuracy of A against the answer keys" in summary


def test_console_scripts_installed():
    """Every console script of pyproject.toml is on PATH next to this interpreter and answers --help."""
    import tomllib

    from conftest import REPO

    scripts = tomllib.loads((REPO / "vllm_plugin" / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"clef-systemone", "clef-bench", "clef-parity", "clef-load", "clef-make-tiny"} <= set(scripts)
    for name in scripts:
        exe = shutil.which(name, path=str(Path(sys.executable).parent))
        assert exe is not None, f"{name} not installed (pip install -e ./vllm_plugin)"
        out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "usage:" in out.stdout, (name, out.stderr[-2000:])
    for name in ("clef-bench", "clef-parity"):
        out = subprocess.run([shutil.which(name, path=str(Path(sys.executable).parent)), "--version"],
                             capture_output=True, text=True, check=True)
        assert out.stdout.startswith("clef-vllm ")


def test_bench_and_parity_against_a_hosted_dialect_server(live_server, hosted_server, tiny_release,
                                                         tiny_short_tokens, tmp_path):
    # clef-bench unwraps the {result, success, ...} envelope and still checks the token counts.
    rc, res = _bench([hosted_server.url, "--tokenizer", str(tiny_release), "--short-tokens", str(tiny_short_tokens),
                      "-c", "2", "-n", "4", "--warmup", "0", "--fail-on-error"], tmp_path / "hosted.json")
    assert rc == 0
    _check_point(res["points"][0])
    # Two different servers, one model: the same probabilities (confidence formulas differ, and are ignored).
    out = tmp_path / "dialects.json"
    rc = parity_main([live_server.url, hosted_server.url, "--synthetic", "8", "--synthetic-max-words", "120",
                      "-c", "1", "--noise-floor", "b",
                      "--noise-concurrency", "3", "-o", str(out), "--no-progress"])
    assert rc == 0
    receipt = json.loads(out.read_text())
    cmp_ = receipt["comparison"]
    assert cmp_["requests_compared"] == 8 and cmp_["problems"] == [] and cmp_["input_token_mismatches"] == 0
    assert cmp_["overall"]["top1_agreement"] == 1.0 and cmp_["overall"]["max_abs_dp"] == 0
    assert list(receipt["noise_floor"]) == ["B"]
    _flips_are_near_ties(receipt["noise_floor"]["B"]["comparison"])


def test_the_gpu_timeline_splits_each_request_window_into_lead_busy_gaps_and_tail():
    from clef_vllm.bench.gpu_timeline import split_window, timeline, union_length

    assert union_length([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    kernels = [(3, 5), (4, 8), (10, 12), (13, 14),        # request 1: window 0..20
               (32, 40)]                                 # request 2: window 30..41
    assert split_window((0, 20), kernels) == {"lead": 3, "busy": 8, "gaps": 3, "tail": 6, "kernels": 4}
    assert split_window((30, 41), kernels) == {"lead": 2, "busy": 8, "gaps": 0, "tail": 1, "kernels": 1}
    assert split_window((50, 60), kernels)["lead"] == 10             # no kernel: all of it is lead
    assert timeline([(0, 20), (30, 41)], kernels, scale=1.0) == {"lead_ms": 2.5, "busy_ms": 8.0, "gaps_ms": 1.5,
                                                                 "tail_ms": 3.5, "kernels": 2.5}


def test_the_gpu_timeline_attributes_busy_and_idle_time_to_marked_phases():
    from clef_vllm.bench.gpu_timeline import phase_split, phase_timeline

    kernels = [(0, 2), (3, 5), (6, 7), (9, 10), (12, 14)]           # one request, window 0..20
    phases = {"gdn": [(2, 7.5)], "head": [(11, 14)], "elsewhere": [(40, 50)]}
    split = phase_split((0, 20), kernels, phases)
    assert split["gdn"] == {"span": 5.5, "busy": 3, "idle": 2.5}    # 3..5 and 6..7 inside 2..7.5
    assert split["head"] == {"span": 3, "busy": 2, "idle": 1}
    assert split["elsewhere"] == {"span": 0, "busy": 0, "idle": 0}  # outside this request
    assert split["other"] == {"span": 14 - 8.5, "busy": 3, "idle": 14 - 8.5 - 3}
    assert phase_split((30, 31), kernels, phases) == {}
    assert phase_timeline([(0, 20)], kernels, phases, scale=1.0)["head"] == {"span_ms": 3, "busy_ms": 2,
                                                                             "idle_ms": 1}


def test_profile_phases_wrap_only_when_switched_on(monkeypatch):
    from clef_vllm.util import trace

    def f(x):
        return x + 1

    monkeypatch.setattr(trace, "PHASES", False)
    assert trace.phased("clef_head", f) is f
    monkeypatch.setattr(trace, "PHASES", True)
    wrapped = trace.phased("clef_head", f)
    assert wrapped is not f and wrapped(1) == 2 and wrapped.__name__ == "f"


# --------------------------------------------------------------------------- paired A/B (--versus)


def test_paired_summary_compares_p50s_per_block_and_counts_unpaired():
    from clef_vllm.bench.paired import paired_summary

    a = [0.030] * 45 + [None, 0.030]
    b = [0.033] * 20 + [0.027] * 25 + [0.040, None]
    s = paired_summary(a, b, block=20)
    assert s["pairs"] == 45 and s["unpaired"] == 2          # a pair counts only if both servers answered
    assert s["a_p50_ms"] == 30.0 and s["ratio"] == pytest.approx(0.9)
    # 45 pairs in blocks of 20: the 5 left over join the second block; the first block has B slower
    assert s["block_ratios"] == [pytest.approx(1.1), pytest.approx(0.9)] and s["b_slower_blocks"] == 1
    assert paired_summary([None], [0.1])["ratio"] is None
    with pytest.raises(ValueError):
        paired_summary(a, b, block=0)


def test_blocks_alternate_abba_and_compare_throughput_per_pair():
    from clef_vllm.bench.paired import block_side, blocks_summary

    assert [block_side(k) for k in range(8)] == [0, 1, 1, 0, 0, 1, 1, 0]

    def blk(side, rps, p50, sent=10, ok=10, steady=None):
        return {"side": side, "req_per_s": rps, "p50_ms": p50, "sent": sent, "ok": ok, "steady_req_per_s": steady}

    s = blocks_summary([blk("a", 10, 100, steady=10), blk("b", 12, 90, steady=10.5),
                        blk("b", 11, 95, ok=9, steady=9), blk("a", 10, 100, steady=10),
                        blk("a", 10, 100)])     # a lone last block has no partner
    assert s["pair_ratios"] == [1.2, 1.1] and s["ratio"] == pytest.approx(1.15) and s["b_faster_pairs"] == 2
    assert s["a_req_per_s"] == 10 and s["b_req_per_s"] == 11.5 and s["p50_ratio"] == pytest.approx(0.925)
    assert s["steady_pair_ratios"] == [1.05, 0.9] and s["steady_ratio"] == pytest.approx(0.975)
    assert s["unanswered"] == 1
    assert blocks_summary([])["ratio"] is None and blocks_summary([])["steady_ratio"] is None


def test_a_blocks_steady_throughput_is_concurrency_over_mean_latency_after_its_start():
    """Little's law per block: with c requests in flight, c over their mean latency, counting only the
    requests started after STEADY_FROM of the block (the first ones meet a server that was idle). A
    server whose first requests are slow, then steady at 20 ms, reads 4 / 20 ms = 200 req/s steady,
    whatever its first requests and its drain did to the wall-time throughput."""
    import asyncio

    from clef_vllm.bench.loadgen import Outcome
    from clef_vllm.bench.paired import STEADY_FROM, blocks_summary, paired_table, run_blocks

    def sender(first_slow):
        async def send(req):
            t = 0.1 if req < first_slow else 0.02
            await asyncio.sleep(t)
            return Outcome("200", t)
        return send

    blocks, wrapped = asyncio.run(run_blocks(list(range(200)), 4, sender(4), sender(0), blocks=2, block_s=0.4))
    a, b = blocks
    assert STEADY_FROM * 0.4 < 0.1                 # A's slow first requests start before the steady part
    assert a["steady_req_per_s"] == pytest.approx(200, rel=0.02) and b["steady_req_per_s"] == pytest.approx(200, rel=0.02)
    assert a["req_per_s"] < b["req_per_s"]         # over the wall time the slow start counts
    s = blocks_summary(blocks)
    assert s["steady_ratio"] == pytest.approx(1.0, abs=0.03) and s["ratio"] > 1.05
    table = paired_table({"target": {"a": "A", "b": "B"},
                          "variants": [{"variant": "short", "concurrency": 4, "blocks": blocks, "wrapped": wrapped, **s}]})
    assert "steady B/A (pairs)" in table and f"{s['steady_ratio']:.3f} (" in table
    # every answer of a 20 ms server comes back in step with the other three: groups of 4, as the table says
    assert all(blk["answers_per_group"] == pytest.approx(4, abs=0.5) for blk in blocks)
    assert b["answer_groups"][-1][0] == 4 and sum(size * n for size, n in b["answer_groups"]) == b["ok"]
    assert s["answers_per_group"]["b"] == pytest.approx(4, abs=0.5) and "answers/group A B" in table
    # each block says when it started and how late the clients' own loop ran its timers (none held here)
    assert all(blk["started_unix"] > 1.7e9 and blk["client_loop_stalls"] == [] for blk in blocks)
    assert all(0 <= blk["client_loop_lag_max_ms"] < 100 for blk in blocks)


def test_a_block_records_when_the_clients_own_loop_was_held():
    """A client whose loop is held (a synchronous 0.25 s call in one send) shows as a stall of its block, at
    the time it happened; the other block has none."""
    import asyncio
    import time

    from clef_vllm.bench.loadgen import Outcome
    from clef_vllm.bench.paired import blocks_summary, paired_table, run_blocks

    held = []

    async def holding(req):
        await asyncio.sleep(0.01)
        if not held:
            held.append(req)
            time.sleep(0.25)
        return Outcome("200", 0.01)

    async def free(req):
        await asyncio.sleep(0.01)
        return Outcome("200", 0.01)

    blocks, _ = asyncio.run(run_blocks(list(range(400)), 2, holding, free, blocks=2, block_s=0.6))
    a, b = blocks
    assert len(a["client_loop_stalls"]) == 1 and b["client_loop_stalls"] == []
    at, ms = a["client_loop_stalls"][0]
    assert 200 <= ms <= 400 and 0.0 <= at <= 0.5 and a["client_loop_lag_max_ms"] == ms
    table = paired_table({"target": {"a": "A", "b": "B"},
                          "variants": [{"variant": "short", "concurrency": 2, "blocks": blocks, "wrapped": False,
                                        **blocks_summary(blocks)}]})
    assert "(clients' loop held >= 100 ms: A 1, B 0)" in table


def test_pairs_alternate_which_server_goes_first_and_stop_at_the_time_limit():
    import asyncio

    from clef_vllm.bench.loadgen import Outcome
    from clef_vllm.bench.paired import run_pairs

    calls = []

    def sender(name, delay=0.0):
        async def send(req):
            calls.append((name, req))
            await asyncio.sleep(delay)
            return Outcome("200", 0.01)
        return send

    a, b = asyncio.run(run_pairs([0, 1, 2, 3], sender("A"), sender("B")))
    assert calls == [("A", 0), ("B", 0), ("B", 1), ("A", 1), ("A", 2), ("B", 2), ("B", 3), ("A", 3)]
    assert len(a) == len(b) == 4
    calls.clear()   # each pair takes ~0.1 s: after 0.15 s no new pair starts, the one running finishes
    a, b = asyncio.run(run_pairs(list(range(20)), sender("A", 0.05), sender("B", 0.05), time_limit=0.15))
    assert 2 <= len(a) == len(b) <= 4 and len(calls) == 2 * len(a)


def test_bench_versus_runs_the_same_requests_on_two_live_servers(live_server, hosted_server, tiny_release,
                                                                tiny_short_tokens, tmp_path):
    rc, res = _bench([live_server.url, "--versus", hosted_server.url, "--tokenizer", str(tiny_release),
                      "--short-tokens", str(tiny_short_tokens), "-n", "6", "--warmup", "1", "--fail-on-error",
                      "--label", "a-vs-b"], tmp_path / "paired.json")
    assert rc == 0
    assert res["schema"] == "clef-bench-paired/1" and res["mode"] == "paired" and res["complete"] is True
    assert res["target"] == {"a": live_server.url + "/v1/systemone", "b": hosted_server.url + "/v1/systemone"}
    [v] = res["variants"]
    assert v["variant"] == "short" and v["requests"] == v["pairs"] == 6 and v["unpaired"] == 0
    assert v["a"]["statuses"] == {"200": 6} and v["b"]["statuses"] == {"200": 6}
    assert v["ratio"] == pytest.approx(v["b_p50_ms"] / v["a_p50_ms"], rel=1e-3) and len(v["block_ratios"]) == 1
    assert v["a"]["server_stages_p50_ms"]["engine"] > 0
    assert len(v["latency_ms"]["a"]) == len(v["latency_ms"]["b"]) == 6 and None not in v["latency_ms"]["b"]
    table = (tmp_path / "paired.txt").read_text()
    assert table.startswith("clef-bench paired:") and "\nshort " in table and "B/A" in table


def test_bench_versus_above_c1_takes_turns_in_time_blocks(live_server, hosted_server, tiny_release,
                                                         tiny_short_tokens, tmp_path, capsys):
    rc, res = _bench([live_server.url, "--versus", hosted_server.url, "--tokenizer", str(tiny_release),
                      "--short-tokens", str(tiny_short_tokens), "-c", "2", "-n", "6", "--blocks", "4",
                      "--block-seconds", "0.4", "--warmup", "1", "--fail-on-error"], tmp_path / "blocks.json")
    assert rc == 0
    [v] = res["variants"]
    assert v["concurrency"] == 2 and [b["side"] for b in v["blocks"]] == ["a", "b", "b", "a"]
    assert all(b["ok"] == b["sent"] > 0 and b["statuses"] == {"200": b["sent"]} for b in v["blocks"])
    assert len(v["pair_ratios"]) == 2 and v["ratio"] == pytest.approx(sorted(v["pair_ratios"])[0] / 2
                                                                      + sorted(v["pair_ratios"])[1] / 2, rel=1e-3)
    assert v["a_req_per_s"] > 0 and v["b_req_per_s"] > 0 and v["unanswered"] == 0
    # 6 requests cannot fill four 0.4 s blocks: the pool wrapped, and the table says so
    assert v["wrapped"] is True and "pool wrapped" in (tmp_path / "blocks.txt").read_text()
    with pytest.raises(SystemExit) as exit_:
        bench_main([live_server.url, "--versus", hosted_server.url, "--tokenizer", str(tiny_release), "--blocks", "1"])
    assert exit_.value.code == 2 and "--blocks >= 2" in capsys.readouterr().err


class _StubRawEngine:
    """Stands in for clef_vllm.bench.raw_vllm.RawVllmEngine (vLLM's engine needs a GPU): answers at once and
    records what it was sent, started and closed."""

    made: list["_StubRawEngine"] = []

    def __init__(self, engine_kwargs: dict):
        self.engine_kwargs, self.sent, self.started, self.closed, self.start_s = engine_kwargs, [], False, False, None
        _StubRawEngine.made.append(self)

    async def start(self):
        self.started, self.start_s = True, 0.01

    def describe(self) -> dict:
        return {"engine_kwargs": {"model": self.engine_kwargs["model"]}, "engine_start_s": self.start_s}

    async def send(self, req):
        import asyncio

        from clef_vllm.bench.loadgen import Outcome

        assert self.started and not self.closed
        self.sent.append((req.body, list(req.input_ids)))
        await asyncio.sleep(0.002)
        return Outcome("200", 0.002, input_tokens=len(req.input_ids))

    async def finish_profile(self):
        pass

    def close(self):
        self.closed = True


def test_bench_versus_raw_pairs_a_server_with_raw_vllm_in_this_process(live_server, tiny_release, tiny_short_tokens,
                                                                       tmp_path, monkeypatch, capsys):
    """``--versus-raw MODEL_DIR``: A is the server over HTTP, B raw vLLM's embed pooling of the same token ids in
    this process (started once, closed at the end), paired at c=1 and in time blocks above, with the raw
    options passed to the engine; refused without a URL or beside --versus."""
    from clef_vllm.bench import raw_vllm
    from clef_vllm.schema.encoding import RequestEncoder

    _StubRawEngine.made.clear()
    monkeypatch.setattr(raw_vllm, "RawVllmEngine", _StubRawEngine)
    rc, res = _bench([live_server.url, "--versus-raw", str(tiny_release), "--short-tokens", str(tiny_short_tokens),
                      "-c", "1,2", "-n", "4", "--blocks", "2", "--block-seconds", "0.3", "--warmup", "1",
                      "--raw-load-format", "dummy", "--gpu-memory-utilization", "0.4", "--fail-on-error"],
                     tmp_path / "raw.json")
    assert rc == 0 and res["mode"] == "paired" and res["complete"] is True
    [engine] = _StubRawEngine.made
    assert engine.started and engine.closed
    assert engine.engine_kwargs["load_format"] == "dummy" and engine.engine_kwargs["gpu_memory_utilization"] == 0.4
    assert res["target"] == {"a": live_server.url + "/v1/systemone", "b": f"raw vLLM embed on {tiny_release}"}
    assert res["server"]["b"]["kind"] == "raw-vllm" and res["server"]["b"]["engine_start_s"] == 0.01
    one, two = res["variants"]
    assert one["concurrency"] == 1 and one["pairs"] == 4 and one["unpaired"] == 0
    assert one["a"]["statuses"] == one["b"]["statuses"] == {"200": 4}
    assert two["concurrency"] == 2 and [b["side"] for b in two["blocks"]] == ["a", "b"]
    assert len(two["pair_ratios"]) == 1 and two["unanswered"] == 0
    # B embedded exactly the token ids the server encodes for those requests (the tokenizer: MODEL_DIR's)
    from clef_vllm.schema.dialects import parse_request

    encoder = RequestEncoder.from_pretrained(str(tiny_release))
    assert len(engine.sent) >= 1 + 4 + 1                   # warm-up, the pairs, at least one block request
    for body, ids in engine.sent:
        assert ids == list(encoder.encode(parse_request(body, limits=encoder.request_limits())).input_ids)
    assert "B = raw vLLM embed on" in (tmp_path / "raw.txt").read_text()
    for argv in (["--versus-raw", str(tiny_release), "--raw-vllm", str(tiny_release)],
                 [live_server.url, "--versus", live_server.url, "--versus-raw", str(tiny_release)]):
        with pytest.raises(SystemExit) as exit_:
            bench_main(argv)
        assert exit_.value.code == 2
    assert "--versus-raw needs a server URL (A) and no --versus" in capsys.readouterr().err


def test_bench_versus_a_dead_server_leaves_every_request_unpaired(live_server, tiny_release, tmp_path, capsys):
    dead = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on
    rc, res = _bench([live_server.url, "--versus", dead, "--tokenizer", str(tiny_release), "--short-tokens", "600",
                      "-n", "2", "--warmup", "0", "--timeout", "5", "--fail-on-error"], tmp_path / "dead.json")
    assert rc == 1
    [v] = res["variants"]
    assert v["pairs"] == 0 and v["unpaired"] == 2 and v["ratio"] is None
    assert v["b"]["statuses"] == {"connect_error": 2} and v["a"]["statuses"] == {"200": 2}
    assert v["latency_ms"]["b"] == [None, None] and all(x > 0 for x in v["latency_ms"]["a"])
    with pytest.raises(SystemExit) as exit_:
        bench_main(["--raw-vllm", str(tiny_release), "--versus", dead])
    assert exit_.value.code == 2 and "--versus needs a server URL" in capsys.readouterr().err


def _free_port_pair() -> int:
    """A port P with P+1 and P+2 free too (bench/paired.sh numbers its servers PORT0+1, PORT0+2)."""
    for _ in range(50):
        base = free_port()
        if base + 2 < 65536 and all(_port_free(base + k) for k in (1, 2)):
            return base
    pytest.skip("no three consecutive free ports")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_paired_script_refuses_a_plan_whose_engines_cannot_fit_on_the_gpu(tiny_release, tmp_path):
    """Three GPU servers at 0.28 of the GPU and raw vLLM after them (on an H200 such servers hold 48-49 GiB each
    and raw's engine cannot start) are refused before any server starts, naming what they need; two at 0.25 with
    raw fit, and so do reference servers (no GPU)."""
    root = Path(__file__).resolve().parents[1]

    def run(compare, *servers, **extra):
        env = {**os.environ, "OUT": str(tmp_path), "COMPARE": compare, "PORT0": str(_free_port_pair()),
               "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", **extra}
        return subprocess.run(["bash", str(root / "bench/paired.sh"), str(tiny_release), *servers], env=env,
                              capture_output=True, text=True, timeout=60)

    proc = run("a:raw:short:16,64 b:a:short:64", "a=--load-format dummy", "b=--gc-freeze off", "c=")
    assert proc.returncode == 2
    assert ("refused: 3 server(s) at GPU_SHARE 0.28 (each ~0.07 more beyond it) and raw vLLM's engine need 1.330 "
            "of the GPU") in proc.stderr
    assert not list(tmp_path.glob("server_*.log"))            # nothing started
    fits = run("a:raw:short:64", "a=--definitely-not-a-flag", GPU_SHARE="0.25", GPU_EXTRA="0.07")
    assert "refused" not in fits.stderr and fits.returncode != 2  # past the check (this server then fails to start)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_paired_script_keeps_one_result_per_comparison(tiny_release, tiny_short_tokens, tmp_path):
    """bench/paired.sh on two reference servers: the same two servers compared at c=1 and at c=2 leave two
    result files (one per comparison and concurrency, so no run overwrites another's per-pair data); ENV_<NAME>
    reaches that server's environment only (here the loader's gate, already open, which the server logs)."""
    root = Path(__file__).resolve().parents[1]
    gate = tmp_path / "gate"
    gate.touch()
    env = {**os.environ, "OUT": str(tmp_path), "PORT0": str(_free_port_pair()), "ENV_y": f"CLEF_VLLM_LOAD_GATE={gate}",
           "COMPARE": "x:y:short x:y:short:2", "PAIRS": "4", "TIME_LIMIT": "20",
           "SERVER_FLAGS": "--backend reference",
           "BENCH_ARGS": f"--short-tokens {tiny_short_tokens} --blocks 2 --block-seconds 0.3",
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "PY": sys.executable}
    proc = subprocess.run(["bash", str(root / "bench/paired.sh"), str(tiny_release), "x=", "y="], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    c1 = json.loads((tmp_path / "x_vs_y.json").read_text())
    c2 = json.loads((tmp_path / "x_vs_y_c2.json").read_text())
    assert [v["concurrency"] for v in c1["variants"]] == [1] and c1["variants"][0]["pairs"] == 4
    assert [v["concurrency"] for v in c2["variants"]] == [2] and c2["variants"][0]["unanswered"] == 0
    log = (tmp_path / "paired.log").read_text()
    assert log.count("x vs y: rc 0") == 2 and "c>1, the servers in turns" in log and "c=1, the same requests" in log
    startup = (tmp_path / "startup.txt").read_text()          # each server's start, in one place
    assert startup.count("== x: ready after") == 1 and startup.count("== y: ready after") == 1
    assert "reference backend:" in startup and f"; env CLEF_VLLM_LOAD_GATE={gate})" in startup
    assert "CLEF_VLLM_LOAD_GATE is set" in (tmp_path / "server_y.log").read_text()
    assert "CLEF_VLLM_LOAD_GATE" not in (tmp_path / "server_x.log").read_text()
    for name in ("x", "y"):                                    # each server's /metrics after the comparisons
        metrics = (tmp_path / f"metrics_{name}.txt").read_text()
        assert "clef_requests_total" in metrics and "clef_gc_pause_seconds" in metrics


def test_the_stepped_engine_batches_like_vllm_steps():
    """bench/instant_server.py's stand-in engine: requests waiting when a step begins finish together after
    that step; one arriving during a step waits for the next; a step takes at most its token budget (and at
    least one request, however long); a step lasts its fixed cost plus its per-token cost."""
    import asyncio
    import time

    SteppedEngine = bench_script("instant_server").SteppedEngine

    engine = SteppedEngine(fixed_ms=30, per_token_us=10, budget=1000)
    assert engine.step_seconds(2000) == pytest.approx(0.05)

    async def scenario():
        finished = {}

        async def request(name, tokens, delay=0.0):
            await asyncio.sleep(delay)
            await engine.run(tokens)
            finished[name] = engine.steps

        t0 = time.perf_counter()
        await asyncio.gather(request("a", 400), request("b", 400), request("late", 100, delay=0.01),
                             request("over", 300))       # a + b + over > 1,000 tokens: "over" waits too
        await request("huge", 5000)                       # alone, over the budget: a step of its own
        return finished, time.perf_counter() - t0

    finished, wall = asyncio.run(scenario())
    assert finished == {"a": 1, "b": 1, "over": 2, "late": 2, "huge": 3}
    assert engine.steps == 3
    assert wall >= 0.030 + 0.008 + 0.030 + 0.004 + 0.030 + 0.050     # each step its fixed and per-token cost


def test_the_stepped_engine_holds_by_the_schedulers_batch_wait():
    """With ``--batch-wait-ms`` the stand-in engine decides with the scheduler's own rule 5: after a step of
    four, a lone arrival is held (polling each millisecond) and joins the one that follows it 3 ms later;
    without the wait it runs alone."""
    import asyncio

    from clef_vllm.worker.fast.batch_wait import BatchWait

    SteppedEngine = bench_script("instant_server").SteppedEngine

    def run(wait_ms):
        engine = SteppedEngine(fixed_ms=5, per_token_us=0, budget=1000, batch_wait=BatchWait(wait_ms / 1000))

        async def scenario():
            await asyncio.gather(*(engine.run(10) for _ in range(4)))
            second = asyncio.ensure_future(engine.run(10))
            await asyncio.sleep(0.003)
            await asyncio.gather(second, engine.run(10))

        asyncio.run(scenario())
        return engine

    held = run(20)
    assert held.requests_per_step == {4: 1, 2: 1} and held.batch_wait.held_steps >= 2
    plain = run(0)
    assert plain.requests_per_step == {4: 1, 1: 2} and plain.batch_wait.held_steps == 0


def test_front_end_ab_alternates_two_instant_servers_and_reports_b_over_a(tiny_release, tmp_path):
    """bench/front_end_ab.py: two instant servers with their own flags (here the CPU pool for every body vs
    the default), clef-bench against each in alternating rounds, medians and B over A per concurrency; the
    stage times show where each side did its CPU work."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "ab.json"
    proc = subprocess.run([sys.executable, str(root / "bench/front_end_ab.py"), str(tiny_release), "--a",
                           "--cpu-inline-bytes 0", "--b", "", "-c", "2", "-n", "16", "--rounds", "2", "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    (point,) = result["points"]
    assert point["concurrency"] == 2 and len(point["rounds"]["a"]) == len(point["rounds"]["b"]) == 2
    assert point["b_over_a_req_per_s"] == round(point["b"]["req_per_s"] / point["a"]["req_per_s"], 3)
    assert {"parse", "encode", "engine", "total"} <= set(point["a"]["stages_p50_ms"])
    assert "B/A" in proc.stdout and result["settings"]["a"] == "--cpu-inline-bytes 0"


def test_the_raw_baseline_is_profiled_over_a_window_of_its_requests(tmp_path):
    """clef-bench --raw-vllm under CLEF_VLLM_PROFILE=DIR,START,COUNT: vLLM's profiler starts before raw request
    START and stops after START+COUNT-1, as in the server (every request sent counts, warm-up included), so a
    raw step's composition can be compared with the server's; a window the run leaves open is stopped at the
    end. A stand-in for AsyncLLM (vLLM does not run on CPU)."""
    import asyncio
    from array import array
    from types import SimpleNamespace

    from clef_vllm.bench.raw_vllm import RawVllmEngine
    from clef_vllm.bench.workloads import BenchRequest
    from clef_vllm.util import trace

    calls = []

    class StandIn:
        async def start_profile(self):
            calls.append("start")

        async def stop_profile(self):
            calls.append("stop")

        async def encode(self, prompt, params, request_id):
            calls.append(request_id)
            yield SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"])

        def shutdown(self):
            calls.append("shutdown")

    def run(window: str, n: int) -> list:
        raw = RawVllmEngine({})
        raw.engine, raw._params = StandIn(), object()
        raw._prompt = lambda ids: {"prompt_token_ids": ids}
        raw._profile = trace.ProfileWindow.from_env(window)
        req = BenchRequest("short", {}, b"", 1, 3, input_ids=array("l", [1, 2, 3]))

        async def go():
            outcomes = [await raw.send(req) for _ in range(n)]
            await raw.finish_profile()
            raw.close()
            return outcomes

        calls.clear()
        outcomes = asyncio.run(go())
        assert all(o.status == "200" and o.input_tokens == 3 for o in outcomes)
        return list(calls)

    assert run(f"{tmp_path},1,2", 4) == ["raw-0", "start", "raw-1", "raw-2", "stop", "raw-3", "shutdown"]
    assert run(f"{tmp_path},2,5", 3) == ["raw-0", "raw-1", "start", "raw-2", "stop", "shutdown"]   # left open


def test_clef_bench_measures_with_its_heap_frozen_and_gives_it_back():
    """A full garbage collection over the bench process's ~0.5 M start-up objects pauses every client for ~0.4 s
    (bench/results/cpu_gc_full_collections_*.json): clef-bench freezes them while it measures, and unfreezes them
    after, since tests call its main in their own process."""
    import gc

    from clef_vllm.util.heap import frozen_heap

    assert gc.get_freeze_count() == 0
    with frozen_heap() as frozen:
        assert frozen > 1000 and gc.get_freeze_count() > 1000
        made = [[] for _ in range(10)]                   # allocated after the freeze: not among the frozen
        assert gc.get_freeze_count() <= frozen
    assert gc.get_freeze_count() == 0 and made


def test_latency_py_sweeps_a_bucket_at_every_size_and_keeps_the_generic_ones_outside():
    """``bench/latency.py --sweep LO:HI:STEP`` gives the prefill graphs a bucket at every swept size (the generic
    ones outside the range), so one request of each size runs at its own size; a range it cannot sweep is refused."""
    from clef_vllm.worker.fast.prefill_graphs import DEFAULT_BUCKETS

    latency = bench_script("latency")
    sizes = latency.sweep_sizes("256:320:16")
    assert sizes == [256, 272, 288, 304, 320]
    buckets = latency.sweep_buckets(sizes)
    assert [b for b in buckets if 256 <= b <= 320] == sizes
    assert [b for b in buckets if b < 256 or b > 320] == [b for b in DEFAULT_BUCKETS if b < 256 or b > 320]
    for bad in ("256:320", "320:256:16", "250:300:16", "a:b:c"):
        with pytest.raises(ValueError):
            latency.sweep_sizes(bad)
