"""``ClefScheduler``: vLLM 0.28's scheduler, always used for Clef, with one fix for every request and two
rules for Clef requests under the state cache.

vLLM runs in the engine-core process together with its (single, TP=1) worker, so the scheduler
sees the worker's side cache (:mod:`clef_vllm.worker.fast.state_cache`) directly.

0. **A prompt of exactly ``max_model_len`` tokens finishes.** vLLM caps each chunk of a running
   request at ``max_model_len - computed - 1``, keeping room for the token a generating model
   samples after its prompt. A pooling engine samples nothing, but the cap still applies: the last
   chunk of such a prompt is always one token short, the next step gets zero tokens, and the
   request waits forever without an error (it holds its KV blocks and its client). Any prompt
   that fills the context and needs two chunks hits it: longer than ``max_num_batched_tokens``,
   or split at the reuse boundary with the state cache on (a warm-up step of the 9B server did).
   The scheduler here declares that a step samples no token (as vLLM does for diffusion models),
   which removes the reservation and nothing else for a pooling engine.
1. **A hit never outruns the memory rows.** vLLM's prefix-cache lookup is capped at the request's
   reusable prefix (tokens before its first span, ``HeadSpec.reuse_limit``) and at the leading
   tokens whose memory rows the side cache holds; vLLM's own search then finds the longest hit
   below the cap where the attention blocks and a GDN state agree.
2. **A chunk ends where the next request can resume.** In ``align`` mode vLLM keeps a GDN state
   only where a prefill chunk ends on a block boundary, or, when it matches prefixes at a finer unit
   (``prefix_match_unit``: the state cache sets it to the key unit, 16 tokens), also at the one
   point per prompt it registers as a *partial tail*. By itself vLLM stops every prompt at its last
   full block and registers the partial tail at the prompt's end, both inside the schema, where
   only a request with the same questions could resume. A Clef request's prefill instead stops at
   the end of its keyed reusable prefix (with whole-block matching: the last block boundary in it)
   and at a shared-prefix junction vLLM detected (where this prompt diverges from a cached one),
   then runs to its end. A Clef request with nothing to reuse (a state too short to key) runs in
   one step: nothing it computes could serve a later request.
3. **Nothing past the reusable prefix is cached.** A Clef request's blocks are registered in vLLM's
   prefix cache only by steps that end at or before the end of its keyed prefix, and that end is
   registered as the request's partial tail. Past it nothing could serve a hit (rule 1 caps every
   hit at the reusable prefix), and it keeps vLLM's invariant that a registered GDN block holds the
   state at the block's end: the step after the tail starts inside a block and may run past that
   block's end, so the block still holds the state at the tail.

Requests that are not Clef requests (vLLM's profiling, other pooling tasks) get vLLM's own prefix-cache
lookup and chunk split; rule 0 holds for them too.

4. **No step only to drop finished requests** (every request; ``--idle-cleanup-step on`` restores vLLM's
   way). When the last unfinished request finishes, vLLM's engine core steps once more: a step that
   schedules nothing and only hands the finished ids to the workers (``SchedulerOutput.finished_req_ids``),
   which drop the requests' cached state. It runs right after the finishing step, in the engine core's
   main thread, while its output thread serialises and sends that very answer, and both need the
   interpreter lock. Here the finished ids wait for the next step that schedules work (vLLM's
   ``schedule`` hands them over whatever else it schedules; the model runner drops finished requests
   before it adds new ones). Their KV blocks are freed at finish either way, by the scheduler.
5. **An idle engine may wait briefly for a batch** (``--batch-wait-ms MS``; 2 ms by default for one engine in
   its own process, none with data parallelism or the engine thread).
   Under load a closed loop of clients resubmits over a few milliseconds after a large step answers
   them; an idle engine starts the first one or two at once, and each such step runs padded to a graph
   bucket for one request (a c=16 profile: steps of 14, 1, 1, 2, 14, ...
   requests). With a wait, while nothing is running, the waiting requests are fewer than half the
   largest step of the last second and the oldest has waited less than MS (counted from its arrival at
   this scheduler), new requests are held for this step (vLLM's own ``PAUSED_NEW`` state for the one
   ``schedule`` call): the engine core steps empty and polls again a millisecond later (vLLM's idle
   sleep). One request at a time (a peak of 1) never waits. The decision itself is
   :mod:`clef_vllm.worker.fast.batch_wait`'s.
   Measured on the H200 (BF16, short decisions, 2 ms against none): 1.062x the req/s at c=16, 1.001x at c=64.
"""

from __future__ import annotations

import logging
from time import monotonic

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler

from clef_vllm.contract import PARAMS_KEY, WorkerSettings
from clef_vllm.schema.state_keys import KEY_UNIT
from clef_vllm.util import trace
from clef_vllm.worker.fast import state_cache
from clef_vllm.worker.fast.batch_wait import BatchWait

log = logging.getLogger("clef_vllm")

#: rule 5: where a request's arrival at this scheduler is kept (``time.monotonic()``)
ARRIVED = "_clef_arrived"


def clef_spec(request) -> dict | None:
    """The wire spec of a Clef request (``None``: another request, e.g. vLLM's profiling)."""
    params = getattr(request, "pooling_params", None)
    return (params.extra_kwargs or {}).get(PARAMS_KEY) if params is not None else None


def reuse_info(request) -> tuple[int, list]:
    """``(reuse_limit, unit_keys)`` of a Clef request under the state cache, else ``(0, [])``."""
    spec = clef_spec(request) or {}
    limit = int(spec.get("r", 0) or 0)
    return (limit, spec.get("k") or []) if limit > 0 else (0, [])


def reuse_boundary(limit: int, unit_keys: list, block: int, fine: bool = False) -> int:
    """Where a later request can resume: the end of the keyed reusable prefix (``fine``: vLLM matches
    prefixes at the key unit), else the last block boundary inside it (0: none)."""
    end = min(limit, len(unit_keys) * KEY_UNIT)
    return end if fine else end // block * block


class View:
    """``request`` as one of vLLM's helpers should see it: with the attributes in ``overrides`` replaced
    (rule 3 moves the prompt's end for vLLM's cache bookkeeping; the block hasher sees the hashes so far)."""

    __slots__ = ("_request", "_overrides")

    def __init__(self, request, **overrides):
        object.__setattr__(self, "_request", request)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name):
        overrides = object.__getattribute__(self, "_overrides")
        return overrides[name] if name in overrides else getattr(object.__getattribute__(self, "_request"), name)


def block_hasher(hash_block_size: int, caching_hash_fn, vllm_hasher_factory):
    """vLLM's request block hasher, except that a Clef request's keyed prefix takes its state keys as
    its block hashes (the key of a hash block's last unit) instead of hashing those tokens again.

    Both are chained, collision-resistant fingerprints of exactly the tokens before a block's end
    (vLLM's: SHA-256 over its parent and the block's ids; ours: BLAKE2b over the ids, 16 bytes, so never
    equal to a 32-byte vLLM hash), and the blocks after the keyed prefix chain vLLM's hashing from
    the last key. The front-end already paid for the keys; a 16k-token state is ~1,000 units, which
    vLLM's hasher otherwise recomputes in the engine core on every request's arrival. The keys are
    computed by the plugin's own front-end from the very ids the engine ends up with (``HeadSpec.with_reuse``);
    no client supplies them. Clef requests carry no LoRA or salt data (vLLM's extra keys); a request with images
    (vLLM's multimodal extra keys) has keys that start from a digest of the images, so the fingerprints cover the
    same content.

    A Clef request with nothing to reuse (no keys: a state's first sighting under ``--state-cache-admit
    repeat``, or a state too short to key) gets no hashes at all: it never reads the prefix cache (its
    pooling parameters skip the lookup) and never writes to it (rule 3), so hashing its prompt, 1,016
    SHA-256 units for a 16k-token prompt, would only hold up the engine core. Any other request (vLLM's
    own, or a hash block not a multiple of the key unit) gets vLLM's hashes."""
    base = vllm_hasher_factory(hash_block_size, caching_hash_fn)
    per = hash_block_size // KEY_UNIT if hash_block_size % KEY_UNIT == 0 else 0

    def request_block_hasher(request) -> list[bytes]:
        start = len(request.block_hashes)
        limit, unit_keys = reuse_info(request)
        if not limit and clef_spec(request) is not None:
            return []
        keyed = min(len(unit_keys) // per, request.num_tokens // hash_block_size) if per else 0
        if start >= keyed:
            return base(request)
        ours = [unit_keys[(b + 1) * per - 1] for b in range(start, keyed)]
        return ours + base(View(request, block_hashes=request.block_hashes + ours))

    return request_block_hasher


def install_block_hasher() -> None:
    """Make vLLM's engine core build its request block hasher with :func:`block_hasher` (idempotent;
    called by ``clef_vllm.register``, which vLLM runs in the engine-core process before it builds the
    hasher). The engine core is the only user of that name in vLLM 0.28."""
    from vllm.v1.engine import core

    original = core.get_request_block_hasher
    if getattr(original, "clef", False):
        return

    def get_request_block_hasher(hash_block_size: int, caching_hash_fn):
        return block_hasher(hash_block_size, caching_hash_fn, original)

    get_request_block_hasher.clef = True
    core.get_request_block_hasher = get_request_block_hasher


def capped_chunk(start: int, num_new_tokens: int, prompt_len: int, block: int, budget: int, boundary: int,
                 junction: int = 0) -> int:
    """Tokens of a Clef request's next prefill chunk: every chunk but the last ends on a block boundary,
    and a chunk stops at the reuse ``boundary`` and at a shared-prefix ``junction`` (where another
    request's prompt diverges from this one: its GDN state there serves both) that lie inside it."""
    end = start + num_new_tokens
    if start >= prompt_len:
        return num_new_tokens
    if end < prompt_len:                      # not the last chunk: end on a block boundary
        aligned = end // block * block
        if aligned > start or block <= budget:
            end = aligned
    # A chunk that starts inside a block ends at that block's end while its blocks are cached (before the
    # boundary: vLLM's invariant); past the boundary nothing is cached (rule 3), so it runs on.
    stops = ((start // block + 1) * block if start % block and start < boundary else 0, boundary,
             junction // block * block)
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


class ClefScheduler(Scheduler):
    """See the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.vllm_config.model_config.runner_type == "pooling":
            self.num_sampled_tokens_per_step = 0       # rule 0
        self._warned_no_pool = False
        coordinator = self.kv_cache_manager.coordinator
        self._fine = bool(getattr(self, "mamba_partial_cache_hit", False))   # vLLM registers partial tails
        self._align_side_cache_tails()
        self._cache_blocks = coordinator.cache_blocks
        coordinator.cache_blocks = self._cache_up_to_boundary                 # rule 3
        settings = WorkerSettings.of(self.vllm_config)
        self._idle_cleanup = settings.idle_cleanup_step
        self.batch_wait = BatchWait(settings.batch_wait_ms / 1000.0)
        if self.batch_wait.on:
            log.info("clef scheduler: an idle engine holds up to %g ms for a batch while fewer requests wait than "
                     "half the largest step of the last second (--batch-wait-ms; 0 turns it off)",
                     self.batch_wait.wait_s * 1000.0)

    @property
    def held_steps(self) -> int:
        """Steps that held new requests back (rule 5)."""
        return self.batch_wait.held_steps

    def _hold_new(self, now: float) -> bool:
        """Rule 5: whether this step should leave the waiting requests waiting."""
        if not self.batch_wait.on or not self.waiting or self._pause_state != PauseState.UNPAUSED:
            return False
        return self.batch_wait.hold(now, running=len(self.running), waiting=len(self.waiting),
                                    oldest=getattr(self.waiting.peek_request(), ARRIVED, now))

    def has_finished_requests(self) -> bool:
        """Rule 4: finished ids alone do not make the engine core step (vLLM's ``has_requests`` asks this
        beside ``has_unfinished_requests``); the next step that schedules work carries them."""
        return super().has_finished_requests() and (self._idle_cleanup or self.has_unfinished_requests())

    def _align_side_cache_tails(self) -> None:
        """vLLM's own flag decides whether a prefix may end inside a block; the side cache keeps tails
        exactly then. The worker made the cache before this scheduler existed (at vLLM's memory
        profiling), judging from the cache config alone; from here on it follows vLLM's flag."""
        cache = state_cache.current()
        if cache is not None and cache.tails != self._fine:
            log.warning("clef state cache: vLLM %s prefixes that end inside a block, the side cache expected the "
                        "opposite; it now %s tails", "registers" if self._fine else "does not register",
                        "keeps" if self._fine else "keeps no")
            cache.tails = self._fine

    def add_request(self, request) -> None:
        trace.event("engine_add", request.request_id)
        setattr(request, ARRIVED, monotonic())
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        now = monotonic()
        hold = self._hold_new(now)
        if hold:
            self._pause_state = PauseState.PAUSED_NEW        # for this call only: running requests still run
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            if hold:
                self._pause_state = PauseState.UNPAUSED
        self.batch_wait.stepped(now, len(out.num_scheduled_tokens))
        if trace.PATH is not None:
            for new in out.scheduled_new_reqs:
                trace.event("engine_scheduled", new.req_id)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if trace.PATH is not None:
            done = [rid for rid in scheduler_output.num_scheduled_tokens if rid not in self.requests]
            graphs = trace.report() if done else None      # the worker's counters, once per step
            for rid in done:
                trace.event("engine_done", rid, graphs=graphs)
        return outputs

    def _cache_up_to_boundary(self, request, num_computed_tokens: int) -> None:
        if clef_spec(request) is None:
            return self._cache_blocks(request, num_computed_tokens)
        limit, unit_keys = reuse_info(request)
        boundary = reuse_boundary(limit, unit_keys, self.block_size, self._fine)
        if 0 < num_computed_tokens <= boundary:
            self._cache_blocks(View(request, num_prompt_tokens=boundary), num_computed_tokens)

    def _get_local_prefix_cache_hit(self, request):
        limit, unit_keys = reuse_info(request)
        if not limit:
            return super()._get_local_prefix_cache_hit(request)
        manager = self.kv_cache_manager
        empty = (manager.empty_kv_cache_blocks, 0, 0, False)
        cache = state_cache.current()
        block = self.block_size
        if cache is None and not self._warned_no_pool:
            self._warned_no_pool = True
            log.warning("clef state cache: the scheduler does not see the worker's memory-row pool (the worker "
                        "runs in another process: distributed_executor_backend=%s); no request will reuse a state",
                        self.vllm_config.parallel_config.distributed_executor_backend)
        if cache is None or cache.block != block or not manager.prefix_cache_lookup_enabled(request):
            return empty
        cap = min(request.num_tokens - 1, limit, cache.present(unit_keys))
        if cap < KEY_UNIT:
            return empty
        blocks, hit, uncached = manager.coordinator.find_longest_cache_hit(request.block_hashes, cap)
        boundary = hit + uncached if uncached else 0
        return manager.create_kv_cache_blocks(blocks), hit, boundary, False

    def _mamba_block_aligned_split(self, request, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
                                   num_external_computed_tokens: int = 0) -> int:
        if clef_spec(request) is None:
            return super()._mamba_block_aligned_split(request, num_new_tokens, num_new_local_computed_tokens,
                                                      num_external_computed_tokens)
        limit, unit_keys = reuse_info(request)
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        budget = self.max_num_scheduled_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold
        if threshold > 0:
            budget = min(budget, threshold)
        return capped_chunk(start, num_new_tokens, request.num_prompt_tokens, self.block_size, budget,
                            reuse_boundary(limit, unit_keys, self.block_size, self._fine),
                            min(getattr(request, "shared_prefix_boundary", 0) or 0, limit))


class ClefAsyncScheduler(ClefScheduler, AsyncScheduler):
    """``ClefScheduler`` on vLLM's ``AsyncScheduler`` (``--async-scheduling on``): the engine core schedules
    step N+1 before step N's output is back. A pooling request whose prompt step N completes is not
    scheduled again in N+1: rule 0 makes a step sample nothing, so vLLM's scheduler finds no token left
    for it (no output placeholder is added), and it finishes when N's output arrives."""
