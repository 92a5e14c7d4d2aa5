"""``ClefScheduler`` driven as vLLM 0.28's real scheduler on CPU (a hybrid attention + GDN KV cache
config, block hashes, the prefix cache's block pool), with the model runner's outputs stood in:
every prompt finishes, however its chunks fall, and a state-cache hit comes from vLLM's own lookup."""

from __future__ import annotations

import logging

import pytest

from support import vllm_cpu

pytest.importorskip("vllm")

CLEF = "clef_vllm.worker.scheduler.ClefScheduler"
CLEF_ASYNC = "clef_vllm.worker.scheduler.ClefAsyncScheduler"
VLLM = "vllm.v1.core.sched.scheduler.Scheduler"
MAX_LEN, BLOCK = 256, 32


def ids(n: int, salt: int = 0) -> list[int]:
    return [1000 + salt * 7919 + i for i in range(n)]


def reuse(token_ids: list[int], limit: int) -> dict:
    """The plugin's wire spec for a request whose first ``limit`` tokens are its reusable state."""
    from clef_vllm.schema.state_keys import prefix_keys

    return {"r": limit, "k": list(prefix_keys(token_ids, limit))}


def test_vllm_alone_never_finishes_a_context_filling_prompt_split_in_chunks(tiny_release):
    """Why rule 0 exists: vLLM keeps one token of the context for a sampled token even for pooling, so
    the last chunk of a ``max_model_len`` prompt never runs. If this starts passing, vLLM fixed it."""
    sched = vllm_cpu.scheduler_for(tiny_release, VLLM, MAX_LEN, budget=128)
    chunks = vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, "a", ids(MAX_LEN))])
    assert chunks["a"] == [128, 127, -1]


@pytest.mark.parametrize("state_cache", [False, True], ids=["cache-off", "cache-on"])
@pytest.mark.parametrize("length", [MAX_LEN, MAX_LEN - 1, MAX_LEN - BLOCK, 129])
def test_every_prompt_finishes_however_it_is_chunked(tiny_release, state_cache, length):
    sched = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=128, state_cache=state_cache)
    reqs = [vllm_cpu.pooling_request(sched, "a", ids(length)), vllm_cpu.pooling_request(sched, "b", ids(MAX_LEN, 1))]
    chunks = vllm_cpu.run_scheduler(sched, reqs)
    assert sum(chunks["a"]) == length and sum(chunks["b"]) == MAX_LEN, chunks
    assert all(n % BLOCK == 0 for c in chunks.values() for n in c[:-1]) or not state_cache   # align: block ends


@pytest.mark.parametrize("state_cache", [False, True], ids=["cache-off", "cache-on"])
@pytest.mark.parametrize("length", [MAX_LEN, MAX_LEN - 1, 129, 40])
def test_under_async_scheduling_every_prompt_finishes_and_no_step_runs_a_finished_prompt(tiny_release, state_cache,
                                                                                         length):
    """``--async-scheduling on``: vLLM's batch queue schedules the next step before the last one's output is
    back. Each prompt's chunks still add up to exactly its length (a prompt completed in one step is not
    given a token in the next, which would add one) and every prompt finishes; three requests share
    the steps as with the synchronous scheduler."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    sched = vllm_cpu.scheduler_for(tiny_release, CLEF_ASYNC, MAX_LEN, budget=128, state_cache=state_cache)
    assert isinstance(sched, AsyncScheduler) and sched.num_sampled_tokens_per_step == 0     # rule 0
    lengths = {"a": length, "b": MAX_LEN, "c": 64}
    reqs = [vllm_cpu.pooling_request(sched, rid, ids(n, salt)) for salt, (rid, n) in enumerate(lengths.items())]
    chunks = vllm_cpu.run_scheduler(sched, reqs, depth=2)
    assert {rid: sum(c) for rid, c in chunks.items()} == lengths, chunks
    assert all(n > 0 for c in chunks.values() for n in c), chunks
    sync = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=128, state_cache=state_cache)
    again = [vllm_cpu.pooling_request(sync, rid, ids(n, salt)) for salt, (rid, n) in enumerate(lengths.items())]
    assert vllm_cpu.run_scheduler(sync, again) == chunks


@pytest.mark.parametrize("cls", [CLEF, CLEF_ASYNC], ids=["sync", "async"])
def test_finished_requests_alone_make_no_step_and_ride_on_the_next_one(tiny_release, cls):
    """Rule 4: once the last request finished, the engine core has nothing to step (vLLM would step once
    more only to hand the finished id to the workers); the next step that schedules work hands it over,
    beside the new request. ``--idle-cleanup-step on`` keeps vLLM's step. The finished request's KV
    blocks are back in the pool at once either way."""
    from clef_vllm.contract import WorkerSettings

    sched = vllm_cpu.scheduler_for(tiny_release, cls, MAX_LEN, budget=128)
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    assert vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, "a", ids(100))]) == {"a": [100]}
    assert sched.finished_req_ids == {"a"} and not sched.has_requests()      # no step only to drop it
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free
    sched.add_request(vllm_cpu.pooling_request(sched, "b", ids(40, 1)))
    assert sched.has_requests()
    out = sched.schedule(False)
    assert out.finished_req_ids == {"a"} and out.num_scheduled_tokens == {"b": 40}
    assert not sched.finished_req_ids
    while_running = vllm_cpu.scheduler_for(tiny_release, cls, MAX_LEN, budget=128)   # others still running: vLLM's way
    reqs = [vllm_cpu.pooling_request(while_running, "c", ids(40, 2)),
            vllm_cpu.pooling_request(while_running, "d", ids(200, 3))]
    assert vllm_cpu.run_scheduler(while_running, reqs, max_steps=1) == {"c": [40], "d": [88, -1]}
    assert while_running.finished_req_ids == {"c"} and while_running.has_finished_requests()
    vllms = vllm_cpu.scheduler_for(tiny_release, cls, MAX_LEN, budget=128, settings=WorkerSettings(idle_cleanup_step=True))
    vllm_cpu.run_scheduler(vllms, [vllm_cpu.pooling_request(vllms, "a", ids(100))])
    assert vllms.finished_req_ids == {"a"} and vllms.has_requests()          # --idle-cleanup-step on
    assert vllms.schedule(False).finished_req_ids == {"a"} and not vllms.has_requests()


def test_an_idle_engine_waits_briefly_for_a_batch_only_after_large_steps(tiny_release, monkeypatch, caplog):
    """Rule 5 (``--batch-wait-ms``): with nothing running, fewer waiting requests than half the largest step
    of the last second are held (an empty step, vLLM's PAUSED_NEW for that call only) until enough have
    arrived or the oldest has waited the limit; one request at a time never waits, a running request
    is never held, and without the option nothing is."""
    from vllm.v1.core.sched.interface import PauseState

    from clef_vllm.contract import WorkerSettings
    from clef_vllm.worker import scheduler as clef_scheduler

    clock = [100.0]
    monkeypatch.setattr(clef_scheduler, "monotonic", lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="clef_vllm"):
        sched = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=MAX_LEN,
                                       settings=WorkerSettings(batch_wait_ms=3))
    assert "holds up to 3 ms for a batch" in caplog.text                     # said at start

    def finish(out):
        sched.update_from_output(out, vllm_cpu.runner_output(sched, out))

    def submit(*names):
        for name in names:
            sched.add_request(vllm_cpu.pooling_request(sched, name, ids(20, ord(name))))

    submit("a")                                  # one at a time: the peak is 0, then 1: never held
    out = sched.schedule(False)
    assert list(out.num_scheduled_tokens) == ["a"] and sched.held_steps == 0
    finish(out)
    submit("b")
    out = sched.schedule(False)
    assert list(out.num_scheduled_tokens) == ["b"] and sched.held_steps == 0
    finish(out)
    submit(*"cdefgh")                            # a step of six: half of it, three, now make a batch
    out = sched.schedule(False)
    assert len(out.num_scheduled_tokens) == 6
    finish(out)
    clock[0] += 0.01
    submit("i")                                  # the first of the next wave: held
    out = sched.schedule(False)
    assert out.num_scheduled_tokens == {} and sched.held_steps == 1
    assert sched.get_num_unfinished_requests() == 1 and sched._pause_state == PauseState.UNPAUSED
    clock[0] += 0.001
    submit("j")                                  # two waiting, fewer than three: still held
    assert sched.schedule(False).num_scheduled_tokens == {} and sched.held_steps == 2
    submit("k")                                  # three: a batch
    out = sched.schedule(False)
    assert sorted(out.num_scheduled_tokens) == ["i", "j", "k"] and sched.held_steps == 2
    finish(out)
    clock[0] += 0.01
    submit("l")
    assert sched.schedule(False).num_scheduled_tokens == {}                 # held ...
    clock[0] += 0.0031
    out = sched.schedule(False)                                              # ... until it waited 3 ms
    assert list(out.num_scheduled_tokens) == ["l"] and sched.held_steps == 3
    finish(out)
    clock[0] += 1.5                                                          # the large step is older than 1 s:
    submit("m")                                                              # the peak is 1, no wait
    out = sched.schedule(False)
    assert list(out.num_scheduled_tokens) == ["m"] and sched.held_steps == 3
    assert len(sched.batch_wait.steps) == 1                                            # steps older than a second forgotten
    off = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=MAX_LEN)
    for name in "nopqrs":
        off.add_request(vllm_cpu.pooling_request(off, name, ids(20, 5)))
    assert len(off.schedule(False).num_scheduled_tokens) == 6
    off.add_request(vllm_cpu.pooling_request(off, "t", ids(20, 6)))
    assert list(off.schedule(False).num_scheduled_tokens) == ["t"] and off.held_steps == 0
    assert not off.batch_wait.steps                                                    # without the wait nothing is kept


def test_a_busy_engine_holds_nothing_back(tiny_release, monkeypatch):
    """Rule 5 holds requests only while nothing runs: a prompt in chunks keeps running, and a request that
    arrives meanwhile joins its next step (the clock standing still, so an idle engine would hold it)."""
    from clef_vllm.contract import WorkerSettings
    from clef_vllm.worker import scheduler as clef_scheduler

    clock = [50.0]
    monkeypatch.setattr(clef_scheduler, "monotonic", lambda: clock[0])
    sched = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=128, settings=WorkerSettings(batch_wait_ms=10))
    sched.batch_wait.steps.append((50.0, 16))                                          # a large step just ran
    sched.add_request(vllm_cpu.pooling_request(sched, "long", ids(150)))
    assert sched.schedule(False).num_scheduled_tokens == {}                 # new and alone: held
    clock[0] += 0.011                                                        # it waited 11 ms: it runs
    steps = []
    for _ in range(4):                                                       # (a held request would stay held)
        if not sched.requests:
            break
        out = sched.schedule(False)
        steps.append(dict(out.num_scheduled_tokens))
        sched.update_from_output(out, vllm_cpu.runner_output(sched, out))
        if len(steps) == 1:
            sched.add_request(vllm_cpu.pooling_request(sched, "short", ids(20, 1)))
    assert steps == [{"long": 128}, {"long": 22, "short": 20}] and sched.held_steps == 1


def test_a_context_filling_state_cache_request_stops_at_its_reuse_boundary_and_finishes(tiny_release):
    """The 9B server's warm-up step that never finished: a prompt of exactly max_model_len tokens, one
    step's budget, split at the reuse boundary (the last block boundary before the first span)."""
    sched = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=MAX_LEN, state_cache=True)
    prompt = ids(MAX_LEN)
    chunks = vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, "a", prompt, reuse(prompt, 200))])
    assert chunks["a"] == [192, MAX_LEN - 192]


@pytest.mark.parametrize("unit", [16, None], ids=["unit", "block"])
def test_a_clef_requests_prefix_cache_hashes_are_its_state_keys_then_vllms_chain(tiny_release, unit):
    """The engine core's block hasher (installed by ``register``): a Clef request's keyed prefix takes its
    state keys (a hash block's key is its last unit's), the blocks after it chain vLLM's own hashing
    from the last key, and any other request gets exactly vLLM's hashes."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import core

    from clef_vllm.schema.state_keys import KEY_UNIT, block_keys

    sched = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=128, state_cache=True, unit=unit)
    assert getattr(core.get_request_block_hasher, "clef", False)       # register() ran (scheduler_for)
    size = sched.hash_block_size
    prompt = ids(250)
    spec = reuse(prompt, 216)                                      # 13 keyed units: tokens [0, 208)
    req = vllm_cpu.pooling_request(sched, "a", prompt, spec)
    keyed = spec["k"] if size == KEY_UNIT else block_keys(spec["k"], size)
    assert len(req.block_hashes) == 250 // size and req.block_hashes[:len(keyed)] == keyed
    parent = keyed[-1]
    for b in range(len(keyed), 250 // size):                       # vLLM's chain, from the last key on
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, prompt[b * size:(b + 1) * size])
        assert req.block_hashes[b] == parent
    from clef_vllm.worker.scheduler import View

    vllms = kv_cache_utils.get_request_block_hasher(size, sha256)
    other = vllm_cpu.pooling_request(sched, "b", prompt)           # no keys: vLLM's hashes, all of them
    assert other.block_hashes == vllms(View(other, block_hashes=[])) != req.block_hashes
    assert not set(keyed) & set(other.block_hashes)                # 16-byte keys never equal vLLM's hashes
    short = vllm_cpu.pooling_request(sched, "c", prompt[:100], spec)    # more keys than the prompt's blocks
    assert short.block_hashes == keyed[:100 // size]


def test_a_clef_request_with_nothing_to_reuse_is_not_hashed_and_runs_uncached(tiny_release):
    """A Clef request without keys (a state's first sighting, a state too short to key) neither reads nor
    writes the prefix cache, so the engine core does not hash its prompt; it still runs to the end, and
    the same prompt again is computed again (nothing was cached under any hash)."""
    from clef_vllm.model.features import synthetic_spec

    sched = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=MAX_LEN, state_cache=True)
    prompt = ids(200)
    wire = synthetic_spec(len(prompt)).to_wire()
    assert not wire.get("r") and not wire.get("k")
    first, again = (vllm_cpu.pooling_request(sched, name, prompt, wire) for name in "ab")
    assert first.block_hashes == [] == again.block_hashes
    assert vllm_cpu.run_scheduler(sched, [first])["a"] == [200]
    assert vllm_cpu.run_scheduler(sched, [again])["b"] == [200]
    keyed = vllm_cpu.pooling_request(sched, "c", prompt, reuse(prompt, 192))     # the same ids, keyed: hashed
    assert len(keyed.block_hashes) == 200 // sched.hash_block_size


def test_installing_the_block_hasher_twice_wraps_vllms_once():
    from vllm.v1.engine import core

    from clef_vllm.worker.scheduler import install_block_hasher

    install_block_hasher()
    first = core.get_request_block_hasher
    install_block_hasher()
    assert core.get_request_block_hasher is first and first.clef


def test_a_follow_up_on_the_same_state_gets_vllms_hit_capped_by_the_rows_present(tiny_release):
    import torch

    from clef_vllm.schema.state_keys import block_keys
    from clef_vllm.worker.fast import state_cache

    cache = state_cache.SideCache(capacity=16, block=BLOCK, width=3, dtype=torch.float32, device="cpu")
    state_cache.install(cache)
    try:
        sched = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=MAX_LEN, state_cache=True)
        state = ids(200)
        first, second, third = (state + ids(56, salt) for salt in (1, 2, 3))
        spec = reuse(first, 200)
        assert vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, "a", first, spec)])["a"] == [192, 64]
        # the worker stored no rows yet: vLLM's cached blocks are not used
        assert vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, "b", second, spec)])["b"] == [192, 64]
        for key in block_keys(spec["k"], BLOCK):
            cache.write(key, torch.zeros(BLOCK, 3))
        # rows for the whole keyed prefix: the follow-up computes only what follows its 192 cached tokens
        assert vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, "c", third, spec)])["c"] == [64]
    finally:
        state_cache.install(None)


def test_a_scheduler_that_cannot_see_the_pool_says_so_once_and_grants_no_hit(tiny_release, caplog):
    """With the worker in another process (vLLM's multiprocess executor) the pool is invisible here."""
    sched = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=MAX_LEN, state_cache=True)
    state = ids(200)
    with caplog.at_level("WARNING", logger="clef_vllm"):
        for salt, name in enumerate("abc"):       # one after another: b and c would hit vLLM's cached blocks
            prompt = state + ids(56, salt)
            req = vllm_cpu.pooling_request(sched, name, prompt, reuse(prompt, 200))
            assert vllm_cpu.run_scheduler(sched, [req])[name] == [192, 64]
    assert sum("does not see the worker's memory-row pool" in r.getMessage() for r in caplog.records) == 1


def test_a_clef_request_with_nothing_to_reuse_runs_in_one_step(tiny_release):
    """vLLM stops an align-mode prefill at its last full block so that a later request could resume
    there; a Clef request with no keyed state (too short) can serve nobody, so it runs in one step."""
    from clef_vllm.model.features import synthetic_spec

    sched = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=MAX_LEN, state_cache=True)
    clef = vllm_cpu.pooling_request(sched, "clef", ids(200), synthetic_spec(200).to_wire())
    other = vllm_cpu.pooling_request(sched, "other", ids(200, 1))            # not a Clef request: vLLM's rule
    assert vllm_cpu.run_scheduler(sched, [clef])["clef"] == [200]
    assert vllm_cpu.run_scheduler(sched, [other])["other"] == [192, 8]


def _probe_hit(sched, token_ids: list[int], spec: dict) -> int:
    """What vLLM's own lookup finds cached for ``token_ids`` keyed as ``spec`` (both KV groups agreeing),
    uncapped. With the same spec as a cached request the probe's block hashes are that request's, past its
    keyed prefix too (vLLM's chain from its last key), so a block cached beyond the prefix would be found."""
    probe = vllm_cpu.pooling_request(sched, "probe", token_ids, spec)
    return sched.kv_cache_manager.coordinator.find_longest_cache_hit(probe.block_hashes, len(token_ids) - 1)[1]


def test_matching_at_the_key_unit_resumes_a_follow_up_at_the_end_of_the_state(tiny_release):
    """``--state-cache-match unit`` (vLLM's prefix_match_unit = 16): the first request stops at the end of
    its keyed prefix (208, inside the block 192..224) where vLLM registers its partial tail, nothing past it
    is cached, and a follow-up whose rows are present computes only what follows 208, in one chunk."""
    import torch

    from clef_vllm.schema.state_keys import block_keys
    from clef_vllm.worker.fast import state_cache

    cache = state_cache.SideCache(capacity=32, block=BLOCK, width=3, dtype=torch.float32, device="cpu", tails=True)
    state_cache.install(cache)
    try:
        sched = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=MAX_LEN, state_cache=True, unit=16)
        assert sched._fine
        state = ids(216)                                   # reusable prefix 216 tokens: 13 keyed units = 208
        first, second, third = (state + ids(40, salt) for salt in (1, 2, 3))
        spec = reuse(first, 216)
        assert vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, "a", first, spec)])["a"] == [208, 48]
        # vLLM holds the state up to 208 and nothing past it (block 192..224 still holds the state at 208)
        assert _probe_hit(sched, first, spec) == 208
        # no rows yet: no hit
        assert vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, "b", second, spec)])["b"] == [208, 48]
        for key in block_keys(spec["k"], BLOCK):
            cache.write(key, torch.zeros(BLOCK, 3))
        cache.write(spec["k"][-1], torch.zeros(16, 3))     # the tail: rows 192..208
        for name, prompt in (("c", third), ("d", third)):  # a follow-up leaves the cache as it found it
            assert vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, name, prompt, spec)])[name] == [48]
        assert _probe_hit(sched, first, spec) == 208
        # a longer state that starts with this one resumes at 208 too; before its own end (240) a chunk that
        # starts inside a block ends at the block's end (vLLM's invariant for the blocks it caches)
        longer = state[:208] + ids(40, 9)
        spec2 = reuse(longer, 248)
        chunks = vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, "e", longer, spec2)])["e"]
        assert chunks == [16, 16, 8]
        assert _probe_hit(sched, longer, spec2) == 240
    finally:
        state_cache.install(None)


@pytest.mark.parametrize("unit", [16, None])
def test_the_side_cache_keeps_tails_exactly_when_vllm_registers_them(tiny_release, unit, caplog):
    """One source for "a prefix may end inside a block": vLLM's scheduler flag. A side cache made
    with the opposite guess (before the scheduler existed) follows the scheduler, and says so."""
    import torch

    from clef_vllm.worker.fast import state_cache

    for guess in (True, False):
        cache = state_cache.SideCache(capacity=4, block=BLOCK, width=3, dtype=torch.float32, device="cpu",
                                      tails=guess)
        state_cache.install(cache)
        try:
            caplog.clear()
            sched = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=MAX_LEN, state_cache=True, unit=unit)
            assert sched._fine == bool(unit) and cache.tails == sched._fine
            assert ("side cache expected the opposite" in caplog.text) == (guess != sched._fine)
        finally:
            state_cache.install(None)


def test_matching_at_whole_blocks_keeps_its_block_boundary(tiny_release):
    """``--state-cache-match block``: the first request stops at the last block boundary of its keyed
    prefix (192), and nothing past that is cached."""
    sched = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=MAX_LEN, state_cache=True)
    assert not sched._fine
    prompt = ids(216) + ids(40, 1)
    spec = reuse(prompt, 216)
    assert vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, "a", prompt, spec)])["a"] == [192, 64]
    assert _probe_hit(sched, prompt, spec) == 192


def test_an_unkeyed_request_is_scheduled_as_with_the_cache_off(tiny_release):
    """A short state is not keyed: with the state cache on, after a state was cached and hit, its request
    gets the same single step, the same number of new blocks and the same blocks to zero as with the cache
    off (a short c=1 decision's cost is not in the scheduler's hands)."""

    def steps(sched, requests):
        seen = []
        for r in requests:
            sched.add_request(r)
            while sched.requests:
                out = sched.schedule(False)
                seen.append((r.request_id, dict(out.num_scheduled_tokens),
                             {n.req_id: [len(b) for b in n.block_ids] for n in out.scheduled_new_reqs},
                             len(out.new_block_ids_to_zero or [])))
                sched.update_from_output(out, vllm_cpu.runner_output(sched, out))
        return seen

    def shorts(sched):
        return [vllm_cpu.pooling_request(sched, f"s{i}", ids(60, 100 + i), {"r": 0, "k": []}) for i in range(3)]

    on = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=MAX_LEN, state_cache=True, unit=16)
    state = ids(200, 5)
    warm = [vllm_cpu.pooling_request(on, f"w{i}", state + ids(40, 6 + i), reuse(state + ids(40, 6 + i), 200))
            for i in range(2)]
    for w in warm:                                                   # keyed: split at the state's end
        assert vllm_cpu.run_scheduler(on, [w])[w.request_id] == [192, 48]
    off = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=MAX_LEN)
    cached_on, plain = steps(on, shorts(on)), steps(off, shorts(off))
    assert cached_on == plain and [s[1] for s in plain] == [{"s0": 60}, {"s1": 60}, {"s2": 60}]


def test_the_request_timeline_is_traced_when_asked(tiny_release, tmp_path, monkeypatch):
    """``CLEF_VLLM_TRACE``: the engine core's part of a request's timeline (added, first scheduled, done)."""
    import json

    from clef_vllm.util import trace

    path = tmp_path / "trace.jsonl"
    monkeypatch.setattr(trace, "PATH", str(path))
    sched = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=128)
    vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, "a", ids(200))])
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in events] == ["engine_add", "engine_scheduled", "engine_done"]
    assert all(e["request"] == "a" for e in events) and events[0]["t"] <= events[1]["t"] <= events[2]["t"]
    assert events[2]["graphs"] == {}                                # no worker runners registered here
    monkeypatch.setitem(trace.REPORTERS, "prefill", lambda: {"replays": 3, "fallbacks": {"batch": 1}})
    vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, "c", ids(200))])
    done = json.loads(path.read_text().splitlines()[-1])
    assert done["event"] == "engine_done" and done["graphs"] == {"prefill": {"replays": 3, "fallbacks": {"batch": 1}}}
    assert trace.summary(path.read_text().splitlines()) == {}     # engine-only events: no request to summarise
    monkeypatch.setattr(trace, "PATH", None)
    vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, "b", ids(200))])
    assert len(path.read_text().splitlines()) == 6                 # off: nothing written


def test_the_trace_summary_pairs_both_processes_events_by_request(tmp_path, capsys):
    import json

    from clef_vllm.util import trace

    def ev(t, name, rid, **fields):
        return json.dumps({"t": t, "pid": 1, "event": name, "request": rid, **fields})

    lines = [ev(0.000, "submit", "clef-1-aa", tokens=400), ev(0.001, "sent", "clef-1-aa-1234abcd"),
             ev(0.002, "engine_add", "clef-1-aa-1234abcd"),
             ev(0.003, "engine_scheduled", "clef-1-aa-1234abcd"), ev(0.033, "engine_done", "clef-1-aa-1234abcd"),
             ev(0.035, "received", "clef-1-aa-1234abcd"), ev(0.036, "answer", "clef-1-aa", cached=0),
             ev(1.000, "submit", "clef-2-bb", tokens=417), ev(1.003, "sent", "clef-2-bb-99999999"),
             ev(1.004, "engine_add", "clef-2-bb-99999999"),
             ev(1.005, "engine_scheduled", "clef-2-bb-99999999"), ev(1.045, "engine_done", "clef-2-bb-99999999"),
             ev(1.047, "received", "clef-2-bb-99999999"), ev(1.050, "answer", "clef-2-bb", cached=0),
             ev(2.000, "submit", "clef-3-cc", tokens=16272), ev(2.050, "answer", "clef-3-cc", cached=15872),
             ev(3.000, "submit", "clef-0-dd", tokens=64, warmup=True), ev(3.500, "answer", "clef-0-dd", cached=0),
             ev(4.000, "engine_add", "other-x")]                 # an engine-only request: no pair, ignored
    groups = trace.summary(lines)
    assert list(groups) == ["<= 1,024 tokens", "> 8,192 tokens, cache hit", "warm-up"]
    rows = groups["<= 1,024 tokens"]
    assert [name for name in rows][:len(trace.SEGMENTS)] == [f"{a} -> {b}" for a, b, _ in trace.SEGMENTS]
    assert rows["submit -> sent"] == {"what": trace.SEGMENTS[0][2], "requests": 2, "p50_ms": 2.0}
    assert rows["sent -> engine_add"]["p50_ms"] == 1.0
    assert rows["engine_scheduled -> engine_done"]["p50_ms"] == 35.0
    assert rows["engine_done -> received"]["p50_ms"] == 2.0 and rows["received -> answer"]["p50_ms"] == 2.0
    assert rows["submit -> answer"]["p50_ms"] == 43.0
    assert groups["> 8,192 tokens, cache hit"]["submit -> answer"] == {
        "what": "the backend's engine call", "requests": 1, "p50_ms": 50.0}
    assert groups["warm-up"]["submit -> sent"]["requests"] == 0
    overlapping = lines + [ev(2.010, "submit", "clef-4-ee", tokens=16272), ev(2.060, "answer", "clef-4-ee", cached=1)]
    assert trace.summary(overlapping)["> 8,192 tokens, cache hit"]["submit -> answer"]["requests"] == 2
    alone = trace.summary(overlapping, alone=True)                  # clef-3 and clef-4 overlapped: both left out
    assert "> 8,192 tokens, cache hit" not in alone and alone["<= 1,024 tokens"]["submit -> answer"]["requests"] == 2
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert trace.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "## <= 1,024 tokens" in out and "## warm-up" in out
    assert "submit -> sent" in out and "2.00 ms" in out and "(2 requests)" in out
    # The worker's per-step events split the engine time of a request that ran in one step; a request of
    # two steps (clef-2 here) keeps its engine time whole.
    steps = [ev(0.0045, "step_forward", "*"), ev(0.0065, "step_head", "*"), ev(0.0075, "step_pooled", "*"),
             ev(1.006, "step_forward", "*"), ev(1.007, "step_head", "*"), ev(1.008, "step_pooled", "*"),
             ev(1.020, "step_forward", "*"), ev(1.021, "step_head", "*"), ev(1.022, "step_pooled", "*")]
    rows = trace.summary(lines + steps)["<= 1,024 tokens"]
    segments = trace.step_segments({"step_forward", "step_head", "step_pooled"})
    assert list(rows)[3:9] == ["engine_scheduled -> engine_done"] + [f"{a} -> {b}" for a, b, _ in segments] + [
        "engine_done -> received"]
    assert rows["engine_scheduled -> step_forward"] == {"what": "  vLLM's input preparation and metadata",
                                                        "requests": 1, "p50_ms": 1.5}
    assert rows["step_forward -> step_head"]["p50_ms"] == 2.0 and rows["step_head -> step_pooled"]["p50_ms"] == 1.0
    assert rows["step_pooled -> engine_done"]["p50_ms"] == 25.5
    assert rows["engine_scheduled -> engine_done"]["requests"] == 2      # the whole still counts both
    # The model runner's events (instrument_runner) split vLLM's input preparation further.
    runner = [ev(0.0031, "step_runner", "*"), ev(0.0032, "step_batch", "*"), ev(0.0034, "step_padding", "*"),
              ev(0.0035, "step_metadata", "*"), ev(0.0040, "step_inputs", "*")]
    rows = trace.summary(lines + steps + runner)["<= 1,024 tokens"]
    assert [k for k in rows if k.startswith(("engine_scheduled ->", "step_"))] == [
        "engine_scheduled -> engine_done", "engine_scheduled -> step_runner", "step_runner -> step_batch",
        "step_batch -> step_padding", "step_padding -> step_metadata", "step_metadata -> step_inputs",
        "step_inputs -> step_forward", "step_forward -> step_head", "step_head -> step_pooled",
        "step_pooled -> engine_done"]
    assert rows["engine_scheduled -> step_runner"]["p50_ms"] == pytest.approx(0.1)
    assert rows["step_metadata -> step_inputs"] == {"what": "  the attention metadata (the FA3 and GDN builders)",
                                                    "requests": 1, "p50_ms": 0.5}
    assert rows["step_inputs -> step_forward"]["p50_ms"] == pytest.approx(0.5)
    # the output's way back, split where the engine core sent it and where the server decoded it
    out = [ev(0.0331, "engine_sent", "clef-1-aa-1234abcd"), ev(0.0345, "client_decoded", "clef-1-aa-1234abcd")]
    rows = trace.summary(lines + out)["<= 1,024 tokens"]
    names = list(rows)
    assert names[names.index("engine_done -> received") + 1:][:4] == [
        "engine_done -> engine_sent", "engine_sent -> client_decoded", "client_decoded -> received",
        "received -> answer"]
    assert rows["engine_sent -> client_decoded"] == {"what": "  ZMQ to the server process, decoded there",
                                                     "requests": 1, "p50_ms": pytest.approx(1.4)}
    assert rows["engine_done -> received"]["requests"] == 2
    # events out of order (two steps' interleaved) split nothing
    shuffled = [ev(0.0031, "step_batch", "*"), ev(0.0032, "step_runner", "*")]
    assert "step_runner -> step_batch" not in trace.summary(lines + steps + shuffled)["<= 1,024 tokens"]
    assert "engine_scheduled -> step_forward" not in trace.summary(lines)["<= 1,024 tokens"]   # none: no rows


def test_the_trace_summary_says_which_graphs_each_request_replayed(tmp_path, capsys):
    """``engine_done`` carries the worker's cumulative graph counters; a request's share is the change
    since the previous ``engine_done`` (its own steps when it ran alone)."""
    import json

    from clef_vllm.util import trace

    def ev(t, name, rid, **fields):
        return json.dumps({"t": t, "pid": 1, "event": name, "request": rid, **fields})

    def counters(prefill, head, batch=0):
        return {"prefill": {"replays": prefill, "fallbacks": {"batch": batch} if batch else {}},
                "head": {"replays": head, "fallbacks": {}}}

    lines = [ev(0.0, "submit", "clef-0-ww", tokens=64, warmup=True),
             ev(0.1, "engine_done", "clef-0-ww-00000000", graphs=counters(24, 1, batch=48)),
             ev(0.2, "answer", "clef-0-ww", cached=0),
             ev(1.0, "submit", "clef-1-aa", tokens=400),
             ev(1.03, "engine_done", "clef-1-aa-1234abcd", graphs=counters(48, 2, batch=48)),
             ev(1.04, "answer", "clef-1-aa", cached=0),
             ev(2.0, "submit", "clef-2-bb", tokens=400),            # its step fell back: 24 layers, 'batch'
             ev(2.05, "engine_done", "clef-2-bb-99999999", graphs=counters(48, 3, batch=72)),
             ev(2.06, "answer", "clef-2-bb", cached=0),
             ev(3.0, "submit", "clef-3-cc", tokens=400),
             ev(3.03, "engine_done", "clef-3-cc-abababab", graphs=counters(72, 4, batch=72)),
             ev(3.04, "answer", "clef-3-cc", cached=0)]
    got = trace.graph_summary(lines)
    assert got["warm-up"]["prefill"] == {"requests": 1, "fallbacks": {"batch": 48}, "replays_p50": 24}
    assert got["<= 1,024 tokens"]["prefill"] == {"requests": 3, "fallbacks": {"batch": 24}, "replays_p50": 24}
    assert got["<= 1,024 tokens"]["head"] == {"requests": 3, "fallbacks": {}, "replays_p50": 1}
    assert "graphs" not in trace.timelines(lines)["clef-2-bb"]         # the cumulative counters stay in the file
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert trace.main([str(path)]) == 0
    printed = capsys.readouterr().out
    assert "prefill graphs" in printed and "24 replays per request (median of 3); fallbacks: batch 24" in printed
    assert trace.graph_summary(lines[:3] + [ev(9.0, "submit", "clef-9-zz", tokens=9), ev(9.1, "answer", "clef-9-zz")]) \
        == {"warm-up": got["warm-up"]}                             # a request without counters: no graph row


def test_the_front_ends_hand_offs_are_traced_on_asyncllms_own_objects(tmp_path, monkeypatch):
    """``sent`` when AsyncLLM handed a request to the engine core's client, ``received`` when its final
    output reached the output processor; a request still running (not finished) logs nothing yet."""
    import asyncio
    import json
    from types import SimpleNamespace

    from vllm.v1.engine import EngineCoreOutput, FinishReason

    from clef_vllm.util import trace

    calls = []

    class Core:
        async def add_request_async(self, request):
            calls.append(("add", request.request_id))

    class Outputs:
        def process_outputs(self, outs, timestamp=None, stats=None):
            calls.append(("process", [o.request_id for o in outs]))
            return "processed"

    from vllm.v1.serial_utils import MsgpackDecoder

    # instrument() also wraps vLLM's decoder class (client_decoded): restored after this test
    monkeypatch.setattr(MsgpackDecoder, "decode", MsgpackDecoder.decode)
    engine = SimpleNamespace(engine_core=Core(), output_processor=Outputs())
    monkeypatch.setattr(trace, "PATH", None)
    trace.instrument(engine)                                        # off: nothing wrapped
    assert "add_request_async" not in vars(engine.engine_core)
    path = tmp_path / "trace.jsonl"
    monkeypatch.setattr(trace, "PATH", str(path))
    trace.instrument(engine)
    asyncio.run(engine.engine_core.add_request_async(SimpleNamespace(request_id="clef-1-aa-1234abcd")))
    outs = [EngineCoreOutput(request_id="clef-1-aa-1234abcd", new_token_ids=[], finish_reason=FinishReason.STOP),
            EngineCoreOutput(request_id="clef-2-bb-99999999", new_token_ids=[])]
    assert engine.output_processor.process_outputs(outs, 0.0, None) == "processed"
    assert calls == [("add", "clef-1-aa-1234abcd"), ("process", ["clef-1-aa-1234abcd", "clef-2-bb-99999999"])]
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["event"], e["request"]) for e in events] == [("sent", "clef-1-aa-1234abcd"),
                                                           ("received", "clef-1-aa-1234abcd")]
    assert getattr(MsgpackDecoder.decode, trace.MARKED, False)      # the decoder is marked too


def test_every_override_accepts_what_vllm_passes():
    """vLLM's engine core calls the scheduler with its own arguments (``schedule(throttle_prefills)``):
    each method ClefScheduler overrides takes every parameter vLLM's takes, or passes them all on."""
    import inspect

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from clef_vllm.worker.scheduler import ClefAsyncScheduler, ClefScheduler

    vllm_cpu.setup_env()
    assert ClefAsyncScheduler.__mro__[1:4] == (ClefScheduler, AsyncScheduler, Scheduler)
    for name, ours in vars(ClefScheduler).items():
        for base in (Scheduler, AsyncScheduler):
            theirs = getattr(base, name, None)
            if not callable(ours) or theirs is None or name.startswith("__"):
                continue
            mine = inspect.signature(ours).parameters
            if any(p.kind is p.VAR_POSITIONAL for p in mine.values()) and any(p.kind is p.VAR_KEYWORD
                                                                             for p in mine.values()):
                continue
            assert list(mine) == list(inspect.signature(theirs).parameters), (name, base)


@pytest.mark.parametrize("budget", [24, 48, 128, MAX_LEN])
def test_keyed_requests_finish_under_any_token_budget_when_matching_at_the_key_unit(tiny_release, budget):
    """Unit matching with small step budgets (chunks inside a block, a budget that is not a multiple of
    16): the first request and two follow-ups that arrive together all finish, and the follow-ups
    compute only what follows the state's end (208)."""
    import torch

    from clef_vllm.schema.state_keys import block_keys
    from clef_vllm.worker.fast import state_cache

    cache = state_cache.SideCache(capacity=32, block=BLOCK, width=3, dtype=torch.float32, device="cpu", tails=True)
    state_cache.install(cache)
    try:
        sched = vllm_cpu.scheduler_for(tiny_release, CLEF, MAX_LEN, budget=budget, state_cache=True, unit=16)
        state = ids(216)
        first, second, third = (state + ids(40, salt) for salt in (1, 2, 3))
        spec = reuse(first, 216)
        chunks = vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, "a", first, spec)])["a"]
        assert sum(chunks) == 256 and -1 not in chunks
        assert 208 in [sum(chunks[:i]) for i in range(len(chunks) + 1)]      # a step ended at the state's end
        for key in block_keys(spec["k"], BLOCK):
            cache.write(key, torch.zeros(BLOCK, 3))
        cache.write(spec["k"][-1], torch.zeros(16, 3))
        out = vllm_cpu.run_scheduler(sched, [vllm_cpu.pooling_request(sched, "b", second, spec),
                                             vllm_cpu.pooling_request(sched, "c", third, spec)])
        assert sum(out["b"]) == sum(out["c"]) == 48 and -1 not in out["b"] + out["c"], out
        assert _probe_hit(sched, first, spec) == 208
    finally:
        state_cache.install(None)
