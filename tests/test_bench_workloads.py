"""clef-bench's requests: each workload's exact token counts, its states and questions, request files and
clef-parity's synthetic set (``clef_vllm.bench.workloads``, ``clef_vllm.schema.records``)."""

from __future__ import annotations

import json
import random

import pytest

from clef_vllm.bench.workloads import (RequestFactory, StateWriter, build_variants,
                                       synthetic_parity_set)
from clef_vllm.schema.records import load_request_file
from support.bench import GOOD, write_jsonl


@pytest.mark.parametrize("n", [0, 1, 7, 50, 333, 2000])
def test_state_writer_hits_exact_token_counts(tiny_encoder, n):
    text = StateWriter(tiny_encoder).text(n, random.Random(n))
    assert len(tiny_encoder.tokenize(text)) == n


def test_qwen_tokenizer_workloads_have_exact_totals(hf_tok):
    from clef_vllm.schema.encoding import RequestEncoder

    factory = RequestFactory(RequestEncoder(hf_tok), seed=3)
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
    path = write_jsonl(tmp_path / "r.jsonl", [
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
