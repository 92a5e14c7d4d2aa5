"""Helpers of the clef-bench and clef-parity tests: one clef-bench run read back, the checks every measured point
passes, the near-tie rule for flips, and a request file written from records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clef_vllm.bench.bench_cli import main as bench_main

#: A valid request with one question of each type (the request files' good record).
GOOD = {"model": "clef-flash", "state": "Checkout has been failing for every customer for the last hour.",
        "questions": {"urgent": {"type": "noul", "instructions": "Is this support request urgent?"},
                      "team": {"type": "choice", "instructions": "Which team?",
                               "criteria": {"technical": "Outages", "billing": "Payments"}},
                      "severity": {"type": "score", "criteria": ["None", "Minor", "Major", "Critical"]}}}


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_bench(argv, out: Path) -> tuple[int, dict]:
    """clef-bench with ``argv``, its result written to ``out``: the exit status and the result."""
    rc = bench_main([*argv, "-o", str(out), "--no-progress"])
    return rc, json.loads(out.read_text())


def check_point(p: dict) -> None:
    """A point every request of which was answered, with consistent statistics and matching token counts."""
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


def flips_are_near_ties(section: dict) -> None:
    """Batch composition may flip a near-tie, never a clear decision: every flip's margin on the
    reference side is within the largest probability change seen (x2 for the two options moving)."""
    limit = 2 * section["overall"]["max_abs_dp"] + 1e-4
    assert all(f["a_margin"] <= limit for f in section["flips"]), (limit, section["flips"])
    assert section["overall"]["top1_agreement"] >= 0.9
