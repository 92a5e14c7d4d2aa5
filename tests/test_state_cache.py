"""The state cache's bookkeeping on CPU: content keys, the side pool (LRU, no stale reads), the
scheduler's hit cap and chunk rule, and the pooler reading cached memory rows for a prefix-cache
hit — driven through vLLM's own pooler metadata with synthetic hidden states (the gloo harness).
Hits under a real engine (full / partial hits, eviction, concurrent same-state requests) run on
the GPU: tests/gpu/fast_paths.py (its ``state_cache`` part)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from clef_vllm.schema.state_keys import KEY_UNIT, block_keys, prefix_keys
from support import vllm_cpu


# --------------------------------------------------------------------------- keys


def test_prefix_keys_identify_exact_prefixes():
    ids = list(range(1000, 1100))
    keys = prefix_keys(ids, upto=100)
    assert len(keys) == 100 // KEY_UNIT and len(set(keys)) == len(keys) and all(len(k) == 16 for k in keys)
    assert prefix_keys(ids, 100) == keys                           # deterministic
    assert prefix_keys(ids + [7, 8, 9], 100) == keys               # later tokens do not matter
    changed = ids.copy()
    changed[40] += 1                                               # unit 2 (tokens 32..47)
    other = prefix_keys(changed, 100)
    assert other[:2] == keys[:2] and all(a != b for a, b in zip(other[2:], keys[2:]))
    assert prefix_keys(ids, 15) == [] and prefix_keys(ids, 10_000) == prefix_keys(ids, 96)


def test_prefix_keys_are_chained_blake2b_over_little_endian_ids_and_memoised():
    """The format (pinned against an independent computation), and the memo of recent key lists: a repeat
    returns equal keys as a fresh list (a caller's change cannot reach the memo), another unit size or
    other ids never reuse an entry, and the memo stays bounded."""
    import hashlib
    import struct

    from clef_vllm.schema import state_keys

    ids = [3, 70000, 2**32 - 1] + list(range(200, 261))             # 64 ids: 4 units
    h = hashlib.blake2b(digest_size=16, person=b"clef-state-v1")
    expected = []
    for j in range(4):
        h.update(struct.pack("<16I", *ids[16 * j:16 * (j + 1)]))
        expected.append(h.copy().digest())
    state_keys._memo.clear()
    first = prefix_keys(ids, 64)
    assert first == expected and len(state_keys._memo) == 1
    first.append(b"x")
    again = prefix_keys(ids, 64)
    assert again == expected and again is not first and len(state_keys._memo) == 1
    assert prefix_keys(ids, 64, unit=32) == [expected[1], expected[3]] and len(state_keys._memo) == 2
    assert prefix_keys([4] + ids[1:], 64)[0] != expected[0]
    for n in range(state_keys._MEMO_SIZE + 5):
        prefix_keys(list(range(n, n + 16)), 16)
    assert len(state_keys._memo) == state_keys._MEMO_SIZE
    with pytest.raises(OverflowError):
        prefix_keys([-1] * 16, 16)


def test_block_keys_take_each_blocks_last_unit():
    keys = [bytes([i]) * 16 for i in range(10)]
    assert block_keys(keys, 32) == [keys[1], keys[3], keys[5], keys[7], keys[9]]
    assert block_keys(keys, 48) == [keys[2], keys[5], keys[8]]
    with pytest.raises(ValueError, match="multiple"):
        block_keys(keys, 40)


# --------------------------------------------------------------------------- the side pool


def rows(value: float, block: int = 32, width: int = 3) -> torch.Tensor:
    return torch.full((block, width), value)


def test_side_cache_reads_written_blocks_and_evicts_least_recently_used():
    from clef_vllm.worker.fast.state_cache import SideCache

    cache = SideCache(capacity=2, block=32, width=3, dtype=torch.float32, device="cpu")
    units = prefix_keys(list(range(200)), 200)                     # 12 units: 6 blocks of 32
    other = prefix_keys(list(range(1, 201)), 200)
    a, b, c = block_keys(units, 32)[:3]
    cache.write(a, rows(1))
    cache.write(b, rows(2))
    cache.write(a, rows(9))                                        # present: kept as is, now most recent
    assert torch.equal(cache.read(units, 64), torch.cat([rows(1), rows(2)]))
    assert cache.present(units) == 64 and cache.present(other) == 0 and cache.present(units[:3]) == 32
    cache.read(units, 32)
    cache.write(c, rows(3))                                        # evicts b, the least recently used
    assert b not in cache and a in cache and c in cache
    assert cache.read(units, 64) is None                           # never a partial or stale answer
    assert cache.read(units, 48) is None                           # no tails kept: nothing inside a block
    assert cache.stats.evicted_blocks == 1 and cache.stats.missing_reads == 2 and cache.stats.stored_blocks == 3
    with pytest.raises(ValueError):
        cache.write(b"d", rows(4, block=16))                       # a tail, but this cache keeps none
    with pytest.raises(ValueError):
        SideCache(capacity=2, block=40, width=3, dtype=torch.float32, device="cpu")


def test_side_cache_keeps_the_tail_of_a_prefix_that_ends_inside_a_block():
    """With vLLM matching prefixes at the key unit, a hit can end at the state's end, inside a block:
    the rows from that block's start are one more entry, under the key of the prefix's last unit."""
    from clef_vllm.worker.fast.state_cache import SideCache

    cache = SideCache(capacity=4, block=64, width=3, dtype=torch.float32, device="cpu", tails=True)
    units = prefix_keys(list(range(300)), 300)                     # 18 units; blocks of 4 units
    cache.write(block_keys(units, 64)[0], rows(1, block=64))
    tail = torch.arange(48 * 3, dtype=torch.float32).view(48, 3)
    cache.write(units[6], tail)                                    # a prefix of 112 tokens: 64 + a 48-row tail
    assert cache.present(units[:7]) == 112 and cache.present(units) == 112
    assert cache.present(units[:6]) == 64                          # a shorter keyed prefix: vLLM has no tail there
    assert torch.equal(cache.read(units, 112), torch.cat([rows(1, block=64), tail]))
    assert torch.equal(cache.read(units, 96), torch.cat([rows(1, block=64), tail[:32]]))   # inside the tail
    cache.write(b"x", rows(2, block=64))
    cache.write(b"y", rows(3, block=64))                           # the pool is full
    cache.read(units, 112)                                         # the block and the tail: now most recent
    cache.write(b"z", rows(4, block=64))                           # evicts x, not the tail read just now
    assert b"x" not in cache and units[6] in cache and cache.present(units) == 112
    changed = prefix_keys(list(range(100)) + [7] * 200, 300)       # same first 96 tokens, then different
    assert cache.present(changed) == 64 and cache.read(changed, 112) is None
    assert cache.read(changed, 96) is None                         # keys cannot tell the first 96 tokens agree


def test_side_cache_is_sized_to_cover_the_kv_cache():
    from clef_vllm.worker.fast.state_cache import capacity_for, side_share

    share = side_share(1024, torch.bfloat16, 32768)                # Qwen3.5-9B: 8 attention layers x 4 KiB
    assert share == pytest.approx(2048 / (2048 + 32768))
    assert capacity_for(int(100e9 * share), 528, 1024, torch.bfloat16) == int(100e9 * share // (528 * 2048))


# --------------------------------------------------------------------------- scheduler rules


def test_chunks_end_on_block_boundaries_and_stop_at_the_reuse_boundary():
    from clef_vllm.worker.scheduler import capped_chunk, reuse_boundary

    block, budget = 32, 1024
    assert reuse_boundary(100, [b"k"] * 6, block) == 96           # 6 units = 96 tokens, limit 100
    assert reuse_boundary(100, [b"k"] * 3, block) == 32            # only 48 tokens keyed
    assert reuse_boundary(20, [b"k"], block) == 0
    # vLLM matching prefixes at the key unit: the boundary is the keyed prefix's end
    assert reuse_boundary(100, [b"k"] * 5, block, fine=True) == 80
    assert capped_chunk(0, 300, 300, block, budget, boundary=80) == 80
    assert capped_chunk(80, 220, 300, block, budget, boundary=80) == 220   # past it nothing is cached: one chunk
    assert capped_chunk(48, 252, 300, block, budget, boundary=80) == 16    # before it, a mid-block start ends its block
    # one step for the whole prompt, except one stop at the reuse boundary
    assert capped_chunk(0, 300, 300, block, budget, boundary=96) == 96
    assert capped_chunk(96, 204, 300, block, budget, boundary=96) == 204
    assert capped_chunk(0, 300, 300, block, budget, boundary=0) == 300     # no reusable block: no split
    # a chunk cut by the token budget ends on a block boundary
    assert capped_chunk(0, 100, 300, block, budget, boundary=0) == 96
    assert capped_chunk(96, 100, 300, block, budget, boundary=0) == 96
    # after a cache hit the prompt runs to its end in one chunk
    assert capped_chunk(96, 204, 300, block, budget, boundary=96) == 204
    # a junction with a cached prompt (block-floored) is a stop too, before the reuse boundary
    assert capped_chunk(0, 300, 300, block, budget, boundary=96, junction=70) == 64
    assert capped_chunk(64, 236, 300, block, budget, boundary=96, junction=70) == 32


class FakeManager:
    def __init__(self, hit_blocks: int):
        self.empty_kv_cache_blocks = "empty"
        self.hit_blocks = hit_blocks
        self.caps = []
        self.coordinator = SimpleNamespace(find_longest_cache_hit=self.find)

    def prefix_cache_lookup_enabled(self, request):
        return not request.skip_reading_prefix_cache

    def find(self, hashes, cap):
        self.caps.append(cap)
        hit = min(cap // 32, self.hit_blocks) * 32
        return [f"b{i}" for i in range(hit // 32)], hit, 0

    def create_kv_cache_blocks(self, blocks):
        return blocks


def fake_request(limit, unit_keys, num_tokens=400, skip=False):
    from vllm import PoolingParams

    params = PoolingParams(task="plugin", extra_kwargs={"clef": {"r": limit, "k": unit_keys}},
                           skip_reading_prefix_cache=skip)
    return SimpleNamespace(pooling_params=params, num_tokens=num_tokens, block_hashes=["h"] * 12,
                           skip_reading_prefix_cache=skip)


@pytest.fixture
def side_cache():
    from clef_vllm.worker.fast import state_cache

    cache = state_cache.SideCache(capacity=16, block=32, width=3, dtype=torch.float32, device="cpu")
    state_cache.install(cache)
    yield cache
    state_cache.install(None)


def test_the_hit_is_capped_by_the_rows_present_and_the_reusable_prefix(side_cache):
    pytest.importorskip("vllm")
    vllm_cpu.setup()
    from clef_vllm.worker.scheduler import ClefScheduler

    hit = ClefScheduler._get_local_prefix_cache_hit
    units = prefix_keys(list(range(300)), 300)                     # 18 units = 9 blocks of 32
    blocks = block_keys(units, 32)
    for key in blocks[:5]:
        side_cache.write(key, rows(0, block=32))
    sched = SimpleNamespace(kv_cache_manager=FakeManager(hit_blocks=8), block_size=32, _warned_no_pool=False,
                            vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend="mp")))
    # rows for 5 blocks: vLLM is asked for at most 160 tokens though it holds 8 blocks
    assert hit(sched, fake_request(290, units))[1] == 160 and sched.kv_cache_manager.caps[-1] == 160
    # the reusable prefix ends at 100 tokens: at most 3 blocks
    assert hit(sched, fake_request(100, units))[1] == 96
    # rows for fewer than one block, or a request that skips the cache: no hit, vLLM not asked
    asked = len(sched.kv_cache_manager.caps)
    assert hit(sched, fake_request(290, units[:1]))[1] == 0
    assert hit(sched, fake_request(290, units, skip=True))[1] == 0
    assert len(sched.kv_cache_manager.caps) == asked
    # no side cache in this process (not created yet): never a hit
    from clef_vllm.worker.fast import state_cache

    state_cache.install(None)
    assert hit(sched, fake_request(290, units))[1] == 0


# --------------------------------------------------------------------------- the pooler


def _request(state, questions):
    from clef_vllm.schema.dialects import parse_request

    return parse_request({"model": "m", "state": state, "questions": questions})


@torch.inference_mode()
def test_pooler_answers_a_hit_from_cached_rows_like_a_full_prefill(release_model, encoder, tiny_release):
    from vllm.v1.pool.metadata import PoolingStates

    from clef_vllm.model.features import HeadSpec, RecordAccumulator, accumulate, decide_records
    from clef_vllm.worker.fast import state_cache
    from clef_vllm.worker.pooler import ClefPooler, StateCacheSettings

    m = release_model
    block = 32
    pooler = ClefPooler(m.head, m.lm_table, StateCacheSettings(SimpleNamespace(block_size=block), 1, capacity_blocks=64))
    state = " ".join(f"ticket {i} says checkout fails with error {i * 7}" for i in range(30))
    enc_a = encoder.encode(_request(state, {"urgent": {"type": "noul", "instructions": "Is this urgent?"}}))
    enc_b = encoder.encode(_request(state, {"team": {"type": "choice", "criteria": {"billing": "Pay", "tech": "Ops"}},
                                            "sev": {"type": "score", "criteria": ["lo", "hi"]}}))
    spec_a, spec_b = HeadSpec.from_encoded(enc_a, state_keys=True), HeadSpec.from_encoded(enc_b, state_keys=True)
    shared = enc_a.schema_offset
    assert enc_a.input_ids[:shared] == enc_b.input_ids[:shared] and spec_a.state_keys[:3] == spec_b.state_keys[:3]
    g = torch.Generator().manual_seed(0)
    width = m.config.hidden_size
    h_a = torch.randn(spec_a.num_tokens, width, generator=g).to(torch.bfloat16)
    h_b = torch.cat([h_a[:shared], torch.randn(spec_b.num_tokens - shared, width, generator=g).to(torch.bfloat16)])
    try:
        # request A, whole prompt in one step: its reusable blocks are stored
        out_a = pooler(h_a, vllm_cpu.pooling_metadata([spec_a], [spec_a.num_tokens], [spec_a.num_tokens], [PoolingStates()]))[0]
        cache = state_cache.current()
        stored = min(spec_a.first_span_start, len(spec_a.state_keys) * KEY_UNIT) // block
        assert stored >= 3 and cache.stats.stored_blocks == stored and len(cache) == stored
        # request B hits 3 blocks: vLLM schedules only the rest; the pooler reads the rows
        start = 3 * block
        st = PoolingStates()
        out_b = pooler(h_b[start:], vllm_cpu.pooling_metadata([spec_b], [spec_b.num_tokens - start], [spec_b.num_tokens], [st]))[0]
        assert cache.stats.hits == 1 and cache.stats.reused_tokens == start
        full = RecordAccumulator(spec_b)
        accumulate(m.head, h_b, [(full, 0, spec_b.num_tokens, 0)])
        want = decide_records(m.head, m.lm_table, [full])[0]
        torch.testing.assert_close(out_b, want, atol=2e-3, rtol=0)
        # the reused rows are bit-identical to the rows B would have computed (same rows, same head)
        _, recomputed = m.head.encode_tokens(h_b[:start])
        assert torch.equal(cache.read(spec_b.state_keys, start), recomputed)
        assert torch.isfinite(out_a).all()
        # a hit whose rows are gone is answered with NaN (the backend then recomputes it uncached)
        cache._slots.clear()
        cache._free = list(range(cache.capacity))
        out = pooler(h_b[start:], vllm_cpu.pooling_metadata([spec_b], [spec_b.num_tokens - start], [spec_b.num_tokens],
                                            [PoolingStates()]))[0]
        assert torch.isnan(out).all()
    finally:
        state_cache.install(None)


@torch.inference_mode()
def test_pooler_keeps_the_tail_and_answers_a_hit_at_the_end_of_the_state(release_model, encoder):
    """With vLLM matching prefixes at the key unit the pooler also stores the rows after the keyed
    prefix's last block boundary, and a hit there (inside a block) is answered like a full prefill."""
    from vllm.v1.pool.metadata import PoolingStates

    from clef_vllm.model.features import HeadSpec, RecordAccumulator, accumulate, decide_records
    from clef_vllm.worker.fast import state_cache
    from clef_vllm.worker.pooler import ClefPooler, StateCacheSettings

    m, block = release_model, 32
    settings = StateCacheSettings(SimpleNamespace(block_size=block, prefix_match_unit=KEY_UNIT), 1, capacity_blocks=64)
    pooler = ClefPooler(m.head, m.lm_table, settings)
    state = " ".join(f"order {i} shipped late to depot {i * 3}" for i in range(25))
    spec = HeadSpec.from_encoded(encoder.encode(_request(state, {"late": {"type": "noul", "instructions": "Late?"}})),
                                 state_keys=True)
    end = len(spec.state_keys) * KEY_UNIT
    if end % block == 0:                                        # make the keyed prefix end inside a block
        spec = replace(spec, state_keys=spec.state_keys[:-1])
        end -= KEY_UNIT
    g = torch.Generator().manual_seed(1)
    h = torch.randn(spec.num_tokens, m.config.hidden_size, generator=g).to(torch.bfloat16)
    try:
        pooler(h, vllm_cpu.pooling_metadata([spec], [spec.num_tokens], [spec.num_tokens], [PoolingStates()]))
        cache = state_cache.current()
        assert cache.tails and cache.present(spec.state_keys) == end
        assert len(cache) == end // block + 1                   # the whole blocks and one tail
        out = pooler(h[end:], vllm_cpu.pooling_metadata([spec], [spec.num_tokens - end], [spec.num_tokens], [PoolingStates()]))[0]
        assert cache.stats.hits == 1 and cache.stats.reused_tokens == end and len(cache) == end // block + 1
        full = RecordAccumulator(spec)
        accumulate(m.head, h, [(full, 0, spec.num_tokens, 0)])
        torch.testing.assert_close(out, decide_records(m.head, m.lm_table, [full])[0], atol=2e-3, rtol=0)
        _, recomputed = m.head.encode_tokens(h[:end])
        assert torch.equal(cache.read(spec.state_keys, end), recomputed)
    finally:
        state_cache.install(None)


# --------------------------------------------------------------------------- the front end: which states are kept


def _front_end(admit_on_repeat: bool = True):
    """The vLLM backend's request routing with the engine call stood in: records what each request sent."""
    import asyncio
    from collections import OrderedDict

    from clef_vllm.backends.vllm_backend import StateAffinity, VllmBackend

    backend = VllmBackend.__new__(VllmBackend)
    backend.state_cache, backend.admit_on_repeat = True, admit_on_repeat
    backend.affinity = StateAffinity(1)
    backend._leaders, backend._recent_states, backend._sightings = {}, OrderedDict(), OrderedDict()
    sent = []

    async def encode(prompt, ids, spec, rank=None, use_cache=True):
        entry = {"keyed": bool(spec.state_keys), "start": len(sent)}
        sent.append(entry)
        await asyncio.sleep(0.02)
        entry["end"] = len(sent)
        return torch.zeros(spec.num_options), 0

    backend._encode = encode
    return backend, sent


def test_a_state_is_kept_from_its_second_request_and_a_burst_has_one_leader(encoder):
    import asyncio

    def enc(state: str, q: str = "Is it urgent?"):
        return encoder.encode(_request(state, {"q": {"type": "noul", "instructions": q}}))

    long_a, long_b = "alpha beta gamma " * 400, "delta epsilon zeta " * 400
    assert enc(long_a).schema_offset >= 1024 and enc("short state").schema_offset < 1024
    backend, sent = _front_end()

    def run(*reqs):
        async def together():
            return await asyncio.wait_for(asyncio.gather(*(backend._decide(r) for r in reqs)), 10)
        return asyncio.run(together())

    for state in (long_a, long_a, long_b, long_a, "short state", "short state"):
        run(enc(state))
    # A: first request whole and not cached, then kept; B: first; short states are never keyed
    assert [s["keyed"] for s in sent] == [False, True, False, True, False, False]

    sent.clear()
    run(*(enc("eta theta iota " * 400, f"Question {i}?") for i in range(5)))   # five at once about a new state
    first, leader, *followers = sent
    assert not first["keyed"] and leader["keyed"] and all(f["keyed"] for f in followers)
    assert all(f["start"] >= leader["end"] for f in followers)               # they waited for the leader

    backend, sent = _front_end(admit_on_repeat=False)                        # --state-cache-admit first
    run(enc(long_b))
    assert [s["keyed"] for s in sent] == [True]


def test_the_warm_up_caches_a_state_and_hits_it_when_the_cache_is_on(tiny_release):
    """The first follow-up a client sends must not compile vLLM's GDN-state copy kernel (seen on the GPU:
    ``batch_memcpy_kernel`` JIT-compiled after /health said ready): with the cache on the warm-up ends
    with a keyed state computed, then hit, both running past a block boundary."""
    import asyncio

    from clef_vllm.backends.options import VllmOptions, engine_args
    from clef_vllm.backends.vllm_backend import WARMUP_STATE, WARMUP_TAIL, VllmBackend, warmup_state_cache
    from clef_vllm.schema.encoding import RequestEncoder

    prompts = []

    def warm(state_cache: bool, max_model_len: int = 16384, encoder=None) -> list:
        backend = VllmBackend.__new__(VllmBackend)
        backend.kwargs = {**engine_args(VllmOptions(state_cache=state_cache, max_model_len=max_model_len)),
                          "max_model_len": max_model_len}
        backend.files = SimpleNamespace(text_config={"vocab_size": 500})
        if encoder is not None:                                  # an engine that takes images
            backend.encoder, backend._sees = encoder, True
        calls = []

        async def encode(prompt, ids, spec, rank=None, use_cache=True, warmup=False):
            assert warmup                                        # marked as such in the trace
            calls.append((ids, spec))
            prompts.append(prompt)
            return torch.zeros(spec.num_options), 0

        backend._encode = encode
        asyncio.run(backend._warmup())
        return calls

    calls = warm(True)
    keyed = [(ids, spec) for ids, spec in calls if spec.state_keys]
    assert len(keyed) == 2 and calls[-2:] == keyed                 # last: cached, then hit
    (a, spec_a), (b, spec_b) = keyed
    assert a[:WARMUP_STATE] == b[:WARMUP_STATE] and a[WARMUP_STATE:] != b[WARMUP_STATE:]
    assert len(a) == len(b) == WARMUP_STATE + WARMUP_TAIL and WARMUP_TAIL > 528   # past a 9B block boundary
    assert spec_a.reuse_limit == WARMUP_STATE and spec_a.state_keys == spec_b.state_keys
    spec_a.validate()
    assert not any(spec.state_keys for _, spec in warm(False))     # cache off: nothing keyed
    assert not any("multi_modal_data" in p for p in prompts)
    # an engine that takes images warms its vision tower and vLLM's processor with one 256 x 256 picture
    prompts.clear()
    seeing = warm(True, encoder=RequestEncoder.from_pretrained(tiny_release, pixels=False))
    with_image = [i for i, p in enumerate(prompts) if "multi_modal_data" in p]
    assert len(with_image) == 1 and len(seeing) == len(calls) + 1
    ids, prompt = seeing[with_image[0]][0], prompts[with_image[0]]
    pad = RequestEncoder.from_pretrained(tiny_release).media.pad_id
    assert prompt["prompt_token_ids"].count(pad) == 1 and ids.count(pad) == 64        # 256 x 256 px: 8 x 8 tokens
    assert warmup_state_cache({"enable_prefix_caching": True, "max_model_len": 1024}) is None


def test_the_side_cache_is_sized_from_this_processs_memory_not_the_devices(monkeypatch):
    """Two engines on one GPU (a paired benchmark): the second one's pool is its share of ITS budget. With
    the device's used memory counted, the other engine's 39 GiB left it one block (seen on a GPU)."""
    from clef_vllm.worker.fast import state_cache
    from clef_vllm.worker.pooler import StateCacheSettings, side_capacity

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 140 * gib))  # 80 GiB used
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 18 * gib)          # 18 of them ours
    width, dtype, kv_per_token = 1024, torch.bfloat16, 32768
    settings = StateCacheSettings(SimpleNamespace(block_size=528), kv_per_token, gpu_memory_utilization=0.28)
    blocks = side_capacity(settings, width, dtype, "cuda")
    budget = 0.28 * 140 * gib - 18 * gib
    share = state_cache.side_share(width, dtype, kv_per_token)
    assert blocks == state_cache.capacity_for(budget * share, 528, width, dtype) > 1000
    assert side_capacity(StateCacheSettings(SimpleNamespace(block_size=528), kv_per_token, capacity_blocks=7),
                         width, dtype, "cuda") == 7
