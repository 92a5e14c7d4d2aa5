"""The CPU reference backend (docs/encoding-and-head.md) on the tiny checkpoints, both layouts."""

from __future__ import annotations

import asyncio
import copy
import os
import random
import sys
import threading

import pytest
import torch

from clef_vllm.backends import OptionError, make_backend, resolve_backend
from clef_vllm.backends.base import MicroBatcher
from clef_vllm.backends.reference import ReferenceBackend, cpu_threads
from clef_vllm.model.checkpoint import load_head, locate_checkpoint
from clef_vllm.model.tables import DenseTable, Int8RowTable
from clef_vllm.schema.answers import build_response
from clef_vllm.schema.dialects import parse_request

WORDS = ("the customer order invoice payment refund billing technical sales account support ticket urgent error "
         "outage service login password email team product price plan upgrade cancel status paid overdue draft "
         "total vendor amount today week minor major critical security incident alert spam fraud safe").split()


def generated_requests(n: int, seed: int = 0) -> list[dict]:
    """Varied requests: 1-3 questions of every type, 2-5 options, states of 3-40 words or JSON."""
    rng = random.Random(seed)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    out = []
    for i in range(n):
        questions = {}
        for k in range(rng.randint(1, 3)):
            qtype = rng.choice(["noul", "choice", "score"])
            q = {"type": qtype, "instructions": words(2, 9) + "?"}
            if qtype == "choice":
                q["criteria"] = {f"{rng.choice(WORDS)}_{j}": (words(1, 5) if rng.random() < 0.8 else None)
                                 for j in range(rng.randint(2, 5))}
            elif qtype == "score":
                q["criteria"] = [words(1, 3) for _ in range(rng.randint(2, 5))]
            elif rng.random() < 0.5:
                q["criteria"] = {"true": words(2, 6), "false": words(2, 6)}
            questions[f"q{k}_{rng.choice(WORDS)}"] = q
        state = words(3, 40) if i % 3 else {"ticket": {"id": i, "text": words(3, 20), "score": rng.random()}}
        out.append({"model": "clef-flash", "state": state, "questions": questions})
    return out


@pytest.fixture(scope="module")
def release(tiny_release, cache_dir):
    backend = ReferenceBackend(tiny_release, device="cpu")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def repacked(tiny_repacked, cache_dir):
    backend = ReferenceBackend(tiny_repacked, device="cpu")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def requests_():
    return generated_requests(24)


@pytest.fixture(scope="module")
def release_probs(release, requests_):
    """The release backend's answers to ``requests_`` (one batched call, shared by several tests)."""
    enc = encode_all(release, requests_)
    return enc, release.decide_batch(enc)


def encode_all(backend, requests):
    return [backend.encoder.encode(parse_request(r)) for r in requests]


def test_backend_selection():
    assert resolve_backend("reference") == "reference"
    if not torch.cuda.is_available():
        assert resolve_backend("auto") == "reference"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("tensorrt")


def test_both_layouts_load_and_answer(release, repacked, requests_):
    assert release.files.layout == "release" and isinstance(release.lm_table, DenseTable)
    assert repacked.files.layout == "repacked" and isinstance(repacked.lm_table, Int8RowTable)
    for backend in (release, repacked):
        assert backend.head.dtype == torch.bfloat16
        assert next(backend.model.parameters()).dtype == torch.bfloat16
        assert backend.describe()["layout"] == backend.files.layout
        # what /v1/models shows (README): backend, layout, dtypes, quantization and kernels
        assert {"backend", "layout", "dtype", "head_dtype", "quantization", "kernels"} <= set(backend.describe())
        assert backend.describe()["quantization"] is None and backend.describe()["kernels"]["unquantized"] > 0
        req = parse_request(requests_[0])
        enc = backend.encoder.encode(req)
        body = build_response(req, enc, backend.decide_batch([enc])[0])
        assert list(body["answers"]) == list(requests_[0]["questions"])
        assert body["usage"]["input_tokens"] == enc.num_tokens == len(enc.input_ids)


def test_hidden_states_equal_the_transformers_release_model(release, tiny_release):
    """The loader's name mapping is right: same final-norm states as HF's own from_pretrained."""
    from transformers import Qwen3_5ForConditionalGeneration

    full = Qwen3_5ForConditionalGeneration.from_pretrained(str(tiny_release), dtype=torch.bfloat16,
                                                           attn_implementation="sdpa").eval()
    enc = encode_all(release, generated_requests(2, seed=5))
    ours = release.hidden_states(enc[:1])
    with torch.inference_mode():
        ids = torch.tensor([enc[0].input_ids])
        theirs = full.model.language_model(input_ids=ids, attention_mask=torch.ones_like(ids),
                                           use_cache=False).last_hidden_state
    assert ours.shape == theirs.shape == (1, enc[0].num_tokens, 128)
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    # and lm_head is the release's untied lm_head.weight
    assert torch.equal(release.lm_table.weight, full.lm_head.weight)
    assert not torch.equal(full.lm_head.weight, full.model.language_model.embed_tokens.weight)


def test_probabilities_are_distributions_and_not_flat(release_probs):
    enc, probs = release_probs
    top = []
    for e, p in zip(enc, probs):
        assert p.dtype == torch.float32 and p.shape == (sum(len(f.option_ids) for f in e.fields),)
        for part in p.split([len(f.option_ids) for f in e.fields]):
            assert abs(float(part.sum()) - 1) < 1e-5
            top.append(float(part.max()) - 1 / len(part))
    assert max(top) > 0.2                                  # the tiny model has opinions


def test_int8_tables_agree_with_bf16_tables(release_probs, repacked, requests_):
    """Same seed, same weights; only embed_tokens / lm_head went through per-row int8 (≤ 1e-2)."""
    enc_a, pa = release_probs
    enc_b = encode_all(repacked, requests_)
    assert [e.input_ids for e in enc_a] == [e.input_ids for e in enc_b]
    pb = repacked.decide_batch(enc_b)
    deltas = [float((a - b).abs().max()) for a, b in zip(pa, pb)]
    assert max(deltas) <= 1e-2, max(deltas)
    assert max(deltas) > 0                                  # the int8 path really ran
    for e, a, b in zip(enc_a, pa, pb):
        for x, y in zip(a.split([len(f.option_ids) for f in e.fields]), b.split([len(f.option_ids) for f in e.fields])):
            top2 = x.topk(2).values if len(x) > 1 else x
            if len(x) > 1 and float(top2[0] - top2[1]) > 2e-2:
                assert int(x.argmax()) == int(y.argmax())


def test_a_batch_equals_each_request_alone(release, requests_):
    """Right padding is harmless (causal backbone, masked head): bf16 tolerance."""
    enc = encode_all(release, requests_[:6])
    assert len({e.num_tokens for e in enc}) > 3
    batched = release.decide_batch(enc)
    for e, p in zip(enc, batched):
        torch.testing.assert_close(p, release.decide_batch([e])[0], atol=1e-2, rtol=0)


def test_batch_splitting_keeps_the_order(release, release_probs):
    enc, whole = release_probs[0][:7], release_probs[1][:7]
    saved = release.max_batch_size, release.max_batch_tokens
    try:
        release.max_batch_size = 3
        groups = release._batches(enc)
        assert sorted(i for g in groups for i in g) == list(range(7)) and max(map(len, groups)) == 3
        split = release.decide_batch(enc)
    finally:
        release.max_batch_size, release.max_batch_tokens = saved
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=0)


def test_micro_batched_async_path_equals_the_blocking_path(tiny_release, requests_, cache_dir):
    backend = ReferenceBackend(tiny_release, device="cpu", max_batch_size=4)
    try:
        enc = encode_all(backend, requests_[:6])

        async def run():
            return await asyncio.gather(*(backend.decide(e) for e in enc))

        got = asyncio.run(run())
        for e, p in zip(enc, got):
            torch.testing.assert_close(p, backend.decide_batch([e])[0], atol=1e-2, rtol=0)
    finally:
        backend.close()


def test_float32_is_float32_throughout_and_equals_the_release_math(tiny_release, requests_, cache_dir):
    """dtype="float32" makes backbone AND head float32, as the release's own loader does; the answers
    equal a float32 run of the release's math: transformers' own Qwen3.5 model loaded in float32
    for the hidden states, then the head written out literally (tests/support/release_math.py)."""
    from transformers import Qwen3_5ForConditionalGeneration

    from support.release_math import literal_logits

    backend = make_backend(tiny_release, "reference", dtype="float32", device="cpu")
    try:
        assert backend.head.dtype == torch.float32
        assert {p.dtype for p in backend.model.parameters()} == {torch.float32}
        assert backend.describe()["dtype"] == backend.describe()["head_dtype"] == "float32"
        enc = encode_all(backend, requests_[:4])
        ours = backend.decide_batch(enc)
    finally:
        backend.close()
    full = Qwen3_5ForConditionalGeneration.from_pretrained(str(tiny_release), dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
    head = load_head(locate_checkpoint(tiny_release), dtype=torch.float32)
    E = full.lm_head.weight.detach()
    for e, got in zip(enc, ours):
        ids = torch.tensor([e.input_ids])
        with torch.inference_mode():
            X = full.model.language_model(input_ids=ids, attention_mask=torch.ones_like(ids),
                                          use_cache=False).last_hidden_state[0]
        fields = [(f.type_id, f.question_span, list(f.option_spans)) for f in e.fields]
        want = torch.cat([torch.softmax(logits, 0) for logits in literal_logits(head, X, e.input_ids, E, fields)])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_head_dtype_alone_and_bad_dtypes(tiny_release, release, requests_, cache_dir):
    backend = make_backend(tiny_release, "reference", head_dtype="float32", device="cpu")
    try:
        assert backend.head.dtype == torch.float32
        assert next(backend.model.parameters()).dtype == torch.bfloat16    # the backbone stays bf16
        enc = encode_all(backend, requests_[:4])
        for a, b in zip(backend.decide_batch(enc), release.decide_batch(enc)):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=0)
    finally:
        backend.close()
    with pytest.raises(OptionError, match="'dtype' must be one of"):
        make_backend(tiny_release, "reference", dtype="float16")


def test_inapplicable_and_unknown_options_are_errors_naming_them(tiny_release):
    """Nothing is silently dropped: an option of the vLLM backend, or a misspelt one, is refused."""
    with pytest.raises(OptionError, match="'gpu_memory_utilization' applies to the vllm backend"):
        make_backend(tiny_release, "reference", gpu_memory_utilization=0.5)
    with pytest.raises(OptionError, match="unknown option 'max_batchsize'.*max_batch_size"):
        make_backend(tiny_release, "reference", max_batchsize=4)
    with pytest.raises(OptionError, match="'max_batch_size' must be int"):
        ReferenceBackend(tiny_release, max_batch_size=2.5)


def thread_nice(tid: int) -> int:
    """A thread's nice value, from /proc (field 19 of its stat line)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="niceness is per thread on Linux only")
def test_compute_nice_runs_the_forward_passes_below_the_servers_other_threads(tiny_release, requests_, cache_dir):
    """With compute_nice, the micro-batcher's thread lowers its own priority by that much before its first forward
    pass; the thread that submits (the server's event loop) keeps its own. By default it stays level."""
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    backend = ReferenceBackend(tiny_release, device="cpu", max_batch_size=4, compute_nice=10)
    seen: list[int] = []
    forward = backend.decide_batch

    def spy(batch):
        seen.append(thread_nice(threading.get_native_id()))
        return forward(batch)

    backend.decide_batch = spy                    # the micro-batcher is built at the first decide, with this
    try:
        enc = encode_all(backend, requests_[:3])

        async def run():
            return await asyncio.gather(*(backend.decide(e) for e in enc))

        asyncio.run(run())
        assert seen and set(seen) == {min(19, here + 10)} and backend._batcher.nice == min(19, here + 10)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == here
        assert backend.describe()["compute_nice"] == 10 and backend.describe()["cpu_threads"] == cpu_threads()
    finally:
        backend.close()
    plain = ReferenceBackend(tiny_release, device="cpu")
    try:
        assert asyncio.run(plain.decide(enc[0])) is not None and plain._batcher.nice is None
        assert plain.describe()["compute_nice"] == 0
    finally:
        plain.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="niceness is per thread on Linux only")
def test_the_openmp_workers_of_the_compute_thread_inherit_its_priority():
    """libgomp starts a thread's OpenMP workers at its first parallel op, from that thread: they run at its nice."""
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    before = set(os.listdir("/proc/self/task"))
    threads = torch.get_num_threads()
    started: list[set[str]] = []

    def run(batch):
        torch.set_num_threads(2)
        torch.ones(1 << 22).mul_(2.0).sum()        # large enough for ATen to split it over its threads
        started.append(set(os.listdir("/proc/self/task")) - before)
        return [torch.zeros(1) for _ in batch]

    batcher = MicroBatcher(run, nice=5)
    try:
        from types import SimpleNamespace

        asyncio.run(batcher.submit(SimpleNamespace(num_tokens=1)))
        new = started[0]
        assert len(new) >= 2 and {thread_nice(int(t)) for t in new} == {min(19, here + 5)}  # the worker and its team
    finally:
        batcher.close()
        torch.set_num_threads(threads)


def test_cpu_threads_leave_one_core_to_the_server(monkeypatch):
    """Forward passes on a CPU use every usable core but one (at least one, at most torch's default), unless asked
    otherwise or OMP_NUM_THREADS says how many."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    for cores, want in ((1, 1), (2, 1), (4, 3), (16, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)), raising=False)
        assert cpu_threads(environ={}) == want
    assert cpu_threads(3, environ={}) == 3
    assert cpu_threads(environ={"OMP_NUM_THREADS": "8"}) == 8          # torch's own count, read from it


def test_the_state_cache_answers_later_requests_about_a_state_from_its_kept_pass(tiny_release, cache_dir):
    """``state_cache=True``: a request whose state is at least MIN_REUSE_TOKENS long runs the state once (its
    transformers cache and hidden states kept under a digest of its ids), and every later request about it
    only the rest: the same answers as one pass (float32: to ~1e-6), ``cached_state_tokens`` = the state's
    tokens on a hit, 0 on the first sight and for short states; requests about one state in one batch share
    the pass; the least recently used state goes first past the byte cap; off by default, and the cap alone
    (cache off) is refused."""
    from clef_vllm.schema.state_keys import MIN_REUSE_TOKENS

    rng = random.Random(5)
    long_state = " ".join(rng.choice(WORDS) for _ in range(1400))
    other_state = " ".join(rng.choice(WORDS) for _ in range(1400))

    def ask(state, k):
        return {"model": "m", "state": state, "questions": {
            f"q{k}": {"type": "choice", "instructions": f"Which team {k}?",
                      "criteria": {"billing": "Payments", "technical": "Outages"}},
            "u": {"type": "noul", "instructions": "Urgent?"}}}

    plain = ReferenceBackend(tiny_release, device="cpu", dtype="float32")
    cached = ReferenceBackend(tiny_release, device="cpu", dtype="float32", state_cache=True)
    try:
        assert plain.states is None and plain.describe()["state_cache"] is None
        bodies = [ask(long_state, 1), ask(long_state, 2), ask("short state", 3), ask(other_state, 4),
                  ask(long_state, 5)]
        enc = encode_all(cached, bodies)
        assert enc[0].schema_offset == enc[1].schema_offset >= MIN_REUSE_TOKENS > enc[2].schema_offset
        assert enc[0].input_ids[:enc[0].schema_offset] == enc[1].input_ids[:enc[1].schema_offset]
        want = plain.decide_batch(encode_all(plain, bodies))
        first = cached.decide_batch(enc[:3])                  # one batch: 1 computes the state, 2 reads it
        assert [e.cached_state_tokens for e in enc[:3]] == [0, enc[1].schema_offset, 0]
        later = cached.decide_batch(enc[3:])                  # another state, then the first one again
        assert [e.cached_state_tokens for e in enc[3:]] == [0, enc[4].schema_offset]
        for got, ref in zip(first + later, want):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
        stats = cached.describe()["state_cache"]
        assert stats["states"] == 2 and stats["hits"] == 2 and stats["misses"] == 2 and stats["bytes"] > 0
        # a cap that holds two states: a third evicts the least recently used (other_state: the long state was
        # read after it), and other_state then computes again, evicting the third
        cached.states.capacity = stats["bytes"] + 1
        third = " ".join(rng.choice(WORDS) for _ in range(1400))
        again = encode_all(cached, [ask(third, 6), ask(long_state, 7), ask(other_state, 8)])
        cached.decide_batch(again)
        assert [e.cached_state_tokens for e in again] == [0, again[1].schema_offset, 0]
        assert cached.describe()["state_cache"]["evicted"] == 2 and cached.describe()["state_cache"]["states"] == 2
        # a state larger than the cap is not kept, and its one pass extends the cache itself, not a copy of it
        cached.states.capacity = 1
        copies = []
        real_copy = copy.deepcopy
        body = ask(" ".join(rng.choice(WORDS) for _ in range(1400)), 9)
        big = encode_all(cached, [body])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(copy, "deepcopy", lambda obj, *a: copies.append(obj) or real_copy(obj, *a))
            got = cached.decide_batch(big)[0]
        assert copies == [] and big[0].cached_state_tokens == 0 and cached.describe()["state_cache"]["states"] == 2
        torch.testing.assert_close(got, plain.decide_batch(encode_all(plain, [body]))[0], atol=1e-5, rtol=0)
    finally:
        plain.close()
        cached.close()
    with pytest.raises(OptionError, match="'state_cache_mb' .* no effect with 'state_cache' off"):
        ReferenceBackend(tiny_release, device="cpu", state_cache_mb=64)
