"""clef-parity: the parity math (distributions, TV, KL, flips, accuracy, the noise floor's conditions) and the
tool against a live server and offline backends (``clef_vllm.bench.parity``, ``clef_vllm.bench.parity_cli``)."""

from __future__ import annotations

import json
import math

import pytest

from clef_vllm.bench.parity import compare_runs, distribution, kl_divergence, total_variation
from clef_vllm.bench.parity_cli import main as parity_main
from clef_vllm.bench.targets import Answered, Condition
from support.bench import GOOD, flips_are_near_ties, write_jsonl


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
    flips_are_near_ties(nf)
    summary = receipt_path.with_suffix(".md").read_text()
    assert "| A vs B | overall |" in summary and "| noise A | overall |" in summary and "No flips" in summary
    assert "the noise floor" in summary
    assert "top-1" in capsys.readouterr().out


def test_parity_offline_against_itself_from_file(tiny_release, tmp_path):
    path = write_jsonl(tmp_path / "held_out.jsonl", [
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
