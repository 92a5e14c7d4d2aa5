"""ClefPooler: the joint schema head inside vLLM's worker, as a ``Pooler`` (task ``"plugin"``,
:data:`clef_vllm.contract.POOLING_TASK`).

vLLM calls the pooler on every step with that step's hidden states, also for partial
prefills (chunked prefill). Per request, a :class:`~clef_vllm.model.features.RecordAccumulator`
kept on the request's ``PoolingStates`` absorbs each chunk (memory projection, span sums, last
state); when the prompt is complete the head runs for every request finishing in this step at
once, and the pooler returns that request's fp32 per-option probabilities — a few floats, never
a [L, 4096] tensor. Unfinished requests get ``None`` (vLLM finishes a pooling request on its
first non-None output). With the head graphs on, a step that finishes client requests only (up to
``--head-graph-records``, 16 by default) runs the head's decision from a CUDA graph
(:mod:`clef_vllm.worker.fast.head_graphs`).

Per-request head specs travel in ``PoolingParams.extra_kwargs["clef"]``
(:data:`clef_vllm.contract.PARAMS_KEY`; one packed int32 buffer, msgpack safe). vLLM's memory profiling and
warm-up call the pooler without them: those requests get a synthetic spec so the profiler sees
representative head work.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Set
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.pooler import Pooler, PoolingParamsUpdate

from clef_vllm.contract import PARAMS_KEY, POOLING_TASK
from clef_vllm.model.features import HeadSpec, RecordAccumulator, accumulate, decide_records, synthetic_spec
from clef_vllm.model.head import JointSchemaHead
from clef_vllm.model.tables import LexicalTable
from clef_vllm.schema.state_keys import KEY_UNIT, block_keys
from clef_vllm.util import trace
from clef_vllm.worker.fast import state_cache
from clef_vllm.worker.fast.gemm_warmup import GridRows, warm_gemm_kernels
from clef_vllm.worker.fast.head_graphs import HeadGraphRunner

log = logging.getLogger("clef_vllm")


@dataclass
class StateCacheSettings:
    """How the worker's side cache is made (created at the pooler's first call: vLLM's memory profiling).

    ``cache_config`` is vLLM's (its ``block_size`` is final by then); ``kv_bytes_per_token`` is what
    one token costs in the KV cache, so the pool can hold the rows of every token the KV cache holds.
    ``capacity_blocks`` overrides the computed size (tests)."""

    cache_config: object
    kv_bytes_per_token: int
    gpu_memory_utilization: float = 0.9
    capacity_blocks: int | None = None


def side_capacity(settings: StateCacheSettings, width: int, dtype: torch.dtype, device) -> int:
    """Blocks of memory rows for the pool: ``settings.capacity_blocks``, or the side rows' share of this
    process's KV budget (``gpu_memory_utilization`` of the device, less what this process holds now).

    Only this process's memory counts, as in vLLM's own KV sizing: another engine on the same GPU (a
    second server, a paired benchmark) is not this one's budget. Counting the device's used memory gave
    the second of two servers a one-block pool, so its state cache never hit."""
    if settings.capacity_blocks is not None:
        return settings.capacity_blocks
    device = torch.device(device)
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        budget = settings.gpu_memory_utilization * total - torch.cuda.memory_reserved(device)
    else:
        budget = 1 << 30
    share = state_cache.side_share(width, dtype, settings.kv_bytes_per_token)
    return state_cache.capacity_for(max(budget, 0) * share, settings.cache_config.block_size, width, dtype)


def make_side_cache(settings: StateCacheSettings, width: int, dtype: torch.dtype, device) -> state_cache.SideCache | None:
    """The pool, sized by :func:`side_capacity`."""
    block = int(settings.cache_config.block_size)
    if block % KEY_UNIT:
        log.warning("clef state cache: off (KV block size %d is not a multiple of %d)", block, KEY_UNIT)
        return None
    capacity = side_capacity(settings, width, dtype, device)
    unit = getattr(settings.cache_config, "prefix_match_unit", None)
    cache = state_cache.SideCache(capacity, block, width, dtype, device, tails=bool(unit) and unit < block)
    log.info("clef state cache: memory rows of %d blocks x %d tokens (%.2f GiB) beside the KV cache; hits %s",
             capacity, block, cache.nbytes / 2**30,
             f"to the state's last {unit}-token unit" if cache.tails else "at whole blocks")
    return cache


class ClefPooler(Pooler):
    """Implements vLLM's ``Pooler`` contract; the math lives in :mod:`clef_vllm.model.features`."""

    def __init__(self, head: JointSchemaHead, table: LexicalTable, state_cache_settings: StateCacheSettings | None = None,
                 head_graphs: HeadGraphRunner | None = None, gemm_warmup_rows: int | None = None,
                 gemm_row_grid: bool = False, max_decision_rows: int | None = None):
        super().__init__()
        # Plain references: the head and the table are registered on the model itself.
        object.__setattr__(self, "_head", head)
        object.__setattr__(self, "_table", table)
        self._cache_settings = state_cache_settings
        self.head_graphs = head_graphs
        #: ``--gemm-warmup``: the most rows a step gives the head's GEMMs, until the first real step on a GPU
        #: has run them over a grid of row counts (:mod:`clef_vllm.worker.fast.gemm_warmup`); then ``None``.
        self.gemm_warmup_rows = gemm_warmup_rows
        self._row_grid_wanted = gemm_row_grid
        #: The longest decision (``--max-model-len`` memory rows): a step's records are decided in groups of at most
        #: this many padded rows, and vLLM's profiling step decides one such record (:meth:`_probe_head`), so the
        #: head's largest transient is inside the peak the KV cache is sized around.
        self.max_decision_rows = max_decision_rows
        self._head_probed = False
        #: ``--gemm-row-grid``: once the warm-up has run all its row counts, the head's GEMMs outside its graphs
        #: (the per-token stage, the eager head) run at them (:class:`~clef_vllm.worker.fast.gemm_warmup.GridRows`).
        self.row_grid: GridRows | None = None

    def side_cache(self, device) -> state_cache.SideCache | None:
        """This worker's side cache when the state cache is on (made at the first call)."""
        if self._cache_settings is None:
            return None
        cache = state_cache.current()
        if cache is None:
            cache = make_side_cache(self._cache_settings, self._head.config.width, self._head.dtype, device)
            if cache is None:
                self._cache_settings = None
                return None
            state_cache.install(cache)
        return cache

    def get_supported_tasks(self) -> Set[str]:
        return {POOLING_TASK}

    def get_pooling_updates(self, task) -> PoolingParamsUpdate:
        return PoolingParamsUpdate()

    def _accumulator(self, params, states, prompt_len: int, start: int,
                     cache: state_cache.SideCache | None = None) -> RecordAccumulator | None:
        acc = getattr(states, "clef", None)
        if acc is not None and start == 0 and acc.filled > 0:
            acc = None  # the request was preempted and restarts its prefill
        if acc is None:
            wire = (params.extra_kwargs or {}).get(PARAMS_KEY) if params is not None else None
            synthetic = wire is None
            if synthetic:
                spec = synthetic_spec(prompt_len)
            else:
                try:
                    spec = HeadSpec.from_wire(wire)
                    spec.validate()
                    if spec.num_tokens != prompt_len:
                        raise ValueError(f"spec is for {spec.num_tokens} tokens, prompt has {prompt_len}")
                except (KeyError, TypeError, ValueError) as exc:
                    log.error("clef pooler: bad head spec (%s); request answered with NaN", exc)
                    spec = None
            if spec is None:
                states.clef = False
                return None
            acc = RecordAccumulator(spec)
            acc.synthetic = synthetic
            if start > 0 and not self._start_from_cache(acc, start, cache):
                states.clef = False
                return None
            states.clef = acc
        elif acc is False:
            return None
        if acc.filled != start:
            log.error("clef pooler: chunk starts at %d but %d positions were seen", start, acc.filled)
        return acc

    @staticmethod
    def _start_from_cache(acc: RecordAccumulator, start: int, cache: state_cache.SideCache | None) -> bool:
        """Give a request that vLLM starts at ``start`` (a prefix-cache hit) the memory rows of
        ``[0, start)``; ``False`` if they are not there (never expected: the scheduler grants hits only
        as far as rows exist)."""
        rows = cache.read(acc.spec.state_keys, start) if cache is not None else None
        if rows is None:
            log.error("clef pooler: a request starts at position %d from vLLM's prefix cache but the state cache "
                      "has no memory rows for it; it is answered with NaN (the backend retries it uncached)", start)
            return False
        acc.start_from_cache(rows)
        acc.stored = start
        cache.stats.hits += 1
        cache.stats.reused_tokens += start
        return True

    @staticmethod
    def _store_blocks(acc: RecordAccumulator, cache: state_cache.SideCache) -> None:
        """Store the memory rows of every whole KV block of the keyed prefix computed so far, and its tail
        (the rows after its last block boundary) once it is computed, when the cache keeps tails."""
        keys = acc.spec.state_keys
        end = len(keys) * KEY_UNIT                     # the keyed prefix: where a later request can resume
        block = cache.block
        upto = min(acc.filled, end) // block * block
        blocks = block_keys(keys, block)
        for k in range(acc.stored // block, upto // block):
            cache.write(blocks[k], acc.memory_rows(k * block, (k + 1) * block))
        acc.stored = max(acc.stored, upto)
        if cache.tails and acc.stored < end <= acc.filled:
            cache.write(keys[-1], acc.memory_rows(upto, end))
            acc.stored = end

    def forward(self, hidden_states: torch.Tensor, pooling_metadata) -> list[torch.Tensor | None]:
        if trace.PATH is not None:
            trace.event("step_head", trace.STEP)
        out = self._forward(hidden_states, pooling_metadata)
        if trace.PATH is not None:
            trace.event("step_pooled", trace.STEP)
        return out

    forward = trace.phased(trace.PHASE_HEAD, forward)

    def _warm_gemms(self, device) -> None:
        """Once, at the first call on a GPU outside a graph capture: vLLM's memory profiling run, so the warm-up's
        transient memory (the head's largest shapes) is part of the peak vLLM sizes the KV cache around."""
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        rows, self.gemm_warmup_rows = self.gemm_warmup_rows, None
        report = warm_gemm_kernels(self._head, rows, self._head.dtype, device)
        if self._row_grid_wanted and "stopped" not in report:
            self.row_grid = GridRows(rows)
            log.info("clef GEMM rows: the head's GEMMs outside its graphs run at the warm-up's %d row counts "
                     "(--gemm-row-grid off: at their own)", len(self.row_grid.grid))

    def _probe_head(self, hidden: torch.Tensor) -> None:
        """Once, in vLLM's profiling step (the first call on a GPU outside a graph capture): feed one synthetic
        record of :attr:`max_decision_rows` tokens through the per-token stage in chunks of this step's rows,
        as a served long decision is fed, and decide it eagerly; everything is freed, its trace is the peak."""
        self._head_probed = True
        rows = self.max_decision_rows or 0
        spec = synthetic_spec(rows) if hidden.shape[0] else None
        if spec is None or hidden.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        before = torch.cuda.max_memory_allocated(hidden.device)
        acc = RecordAccumulator(spec)
        acc.synthetic = True
        chunk = hidden.shape[0]
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            accumulate(self._head, hidden[:n], [(acc, 0, n, start)])
        decide_records(self._head, self._table, [acc], None, eager=self.row_grid, max_rows=rows)
        del acc
        log.info("clef memory budget: vLLM's profiling step decided one %d-token record (the longest decision): "
                 "%.2f GiB more at its peak", rows, max(0, torch.cuda.max_memory_allocated(hidden.device) - before)
                 / (1 << 30))

    def _forward(self, hidden_states: torch.Tensor, pooling_metadata) -> list[torch.Tensor | None]:
        cursor = pooling_metadata.get_pooling_cursor()
        scheduled = cursor.num_scheduled_tokens_cpu.tolist()
        seq_lens = cursor.seq_lens_cpu.tolist()
        prompt_lens = cursor.prompt_lens_cpu.tolist()
        params = pooling_metadata.pooling_params
        states = pooling_metadata.pooling_states
        out: list[torch.Tensor | None] = [None] * len(scheduled)
        pieces, finishing, offset = [], [], 0
        device = hidden_states.device
        cache = self.side_cache(device)
        for i, n in enumerate(scheduled):
            start = seq_lens[i] - n
            acc = self._accumulator(params[i], states[i], prompt_lens[i], start, cache)
            done = seq_lens[i] >= prompt_lens[i]
            if acc is not None and n > 0:
                pieces.append((acc, offset, n, start))
                if done:
                    finishing.append((i, acc))
            elif acc is None and done:
                out[i] = torch.full((1,), float("nan"), device=device)
            offset += n
        if self.gemm_warmup_rows and pieces:
            self._warm_gemms(device)
        if not self._head_probed and pieces and device.type == "cuda":
            self._probe_head(hidden_states)
        grid = self.row_grid or contextlib.nullcontext()
        with grid:
            accumulate(self._head, hidden_states, pieces)
        if cache is not None:              # after every read of this step (the scheduler's grants)
            for acc, *_ in pieces:
                self._store_blocks(acc, cache)
        if finishing:
            records = [acc for _, acc in finishing]
            # vLLM's profiling and warm-up runs (synthetic specs) never capture graphs.
            graphs = None if any(acc.synthetic for acc in records) else self.head_graphs
            probs = decide_records(self._head, self._table, records, graphs, eager=grid,
                                   max_rows=self.max_decision_rows)
            for (i, _), p in zip(finishing, probs):
                out[i] = p
                states[i].clef = None
        return out
