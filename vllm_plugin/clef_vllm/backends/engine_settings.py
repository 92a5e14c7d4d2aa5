"""How :class:`~clef_vllm.backends.options.VllmOptions` fields reach vLLM: each function here takes the options
and adds what one field derives to the keywords of ``vllm.AsyncEngineArgs``. A field names its function with
``engine=`` in its declaration; :func:`clef_vllm.backends.options.engine_args` calls them all, then
:func:`worker_settings` builds the one :class:`~clef_vllm.contract.WorkerSettings` the engine's workers get.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from clef_vllm.contract import CLEF_WORKER, SCHEDULER_CLASSES, SHARED_GPU_WORKER, PrefillGraphs, WorkerSettings

if TYPE_CHECKING:  # annotations only: the options module imports this one
    from clef_vllm.backends.options import VllmOptions


def max_num_batched_tokens(opts: VllmOptions, kwargs: dict) -> None:
    """Default: the request limit, at least 8192 and at most 16384 (one chunk holds a typical prompt)."""
    from clef_vllm.plan.memory_plan import batched_tokens

    kwargs["max_num_batched_tokens"] = batched_tokens(opts.max_num_batched_tokens, opts.max_model_len)


def gpu_memory(opts: VllmOptions, kwargs: dict) -> None:
    kwargs["gpu_memory_utilization"] = opts.resolved_gpu_memory_utilization


def engines_per_gpu(opts: VllmOptions, kwargs: dict) -> None:
    """Every engine runs the plugin's worker class, which keeps the process inside its memory budget
    (:mod:`clef_vllm.worker.budget`); engines that share a GPU run its subclass that places them and starts them
    one at a time (:mod:`clef_vllm.worker.fast.shared_gpu`)."""
    kwargs["worker_cls"] = SHARED_GPU_WORKER if opts.engines_per_gpu > 1 else CLEF_WORKER


def prefill_graph_setting(opts: VllmOptions, budget: int) -> PrefillGraphs | None:
    """The worker's GDN prefill graphs (:mod:`clef_vllm.worker.fast.prefill_graphs`) per padded bucket up to the
    step's token ``budget``, or ``None`` when they are off."""
    if not opts.prefill_graphs:
        return None
    from clef_vllm.worker.fast.prefill_graphs import DEFAULT_BUCKETS

    # engine_kwargs has filled in the checkpoint's defaults (prefill_graphs.default_buckets); options alone,
    # with no checkpoint to read, get the generic list
    buckets = tuple(b for b in (opts.prefill_graph_buckets or DEFAULT_BUCKETS) if b <= budget)
    scope = opts.resolved_prefill_graph_scope
    return PrefillGraphs(buckets, scope, opts.step_graph_split if scope == "step" else 0)


def prefill_graphs(opts: VllmOptions, kwargs: dict) -> None:
    """vLLM's piecewise CUDA graphs captured up to the prefill graphs' token counts."""
    setting = prefill_graph_setting(opts, kwargs["max_num_batched_tokens"])
    if setting is None or opts.enforce_eager:
        return
    from clef_vllm.worker.fast.prefill_graphs import cudagraph_capture_sizes

    kwargs["compilation_config"] = {"cudagraph_capture_sizes": cudagraph_capture_sizes(
        kwargs["max_num_batched_tokens"], list(setting.buckets), kwargs["max_num_seqs"],
        between_buckets=setting.scope != "step")}


def state_cache(opts: VllmOptions, kwargs: dict) -> None:
    """vLLM's prefix caching (align mode) for the state cache; the worker keeps the memory rows of cached prefixes
    (:mod:`clef_vllm.worker.fast.state_cache`) and the scheduler (always ours) keeps the two consistent."""
    kwargs["enable_prefix_caching"] = opts.state_cache
    if opts.state_cache and opts.state_cache_match == "unit":
        from clef_vllm.schema.state_keys import KEY_UNIT

        kwargs.update(prefix_match_unit=KEY_UNIT)   # hits and GDN states at the state's end, not at a block's


def scheduling(opts: VllmOptions, kwargs: dict) -> None:
    """Always our scheduler (a context-filling prompt finishes: its rule 0), on vLLM's synchronous
    ``Scheduler`` or, with ``async_scheduling``, on its ``AsyncScheduler``: the engine core then schedules
    and prepares the next step while the GPU runs the current one (vLLM 0.28 leaves that off for pooling
    models unless asked; docs/latency.md, "Async scheduling")."""
    kwargs["async_scheduling"] = opts.async_scheduling
    kwargs["scheduler_cls"] = SCHEDULER_CLASSES[opts.async_scheduling]


def data_parallel_backend(opts: VllmOptions, kwargs: dict) -> None:
    """vLLM's ``data_parallel_backend``, given only when it is not vLLM's default (``mp``)."""
    if opts.data_parallel_backend != "mp":
        kwargs["data_parallel_backend"] = opts.data_parallel_backend


def worker_settings(opts: VllmOptions, budget: int) -> WorkerSettings:
    """The one settings object of the engine's workers, scheduler and worker class, from the options and the step's
    token ``budget``: the features the options turn on (each a module of :mod:`clef_vllm.worker.fast`), the head's
    dtype, the scheduler's rules 4 and 5, the engines per GPU."""
    return WorkerSettings(
        head_dtype=opts.resolved_head_dtype,
        prefill_graphs=prefill_graph_setting(opts, budget),
        head_graph_records=opts.head_graph_records if opts.head_graphs else 0,
        state_cache=opts.state_cache,
        gemm_warmup=opts.gemm_warmup,
        gemm_warmup_rows=opts.gemm_warmup_rows if opts.gemm_warmup else None,
        gemm_row_grid=opts.gemm_warmup and opts.gemm_row_grid,
        gdn_metadata_memo=opts.gdn_metadata_memo,
        gdn_tuning=opts.gdn_tuning,
        # NVFP4 as BF16 GEMMs when asked (auto: the worker decides by its GPU); vLLM's own kernel whenever
        # --linear-backend chooses
        nvfp4_kernel="vllm" if opts.linear_backend_chosen else opts.nvfp4_kernel,
        engines_per_gpu=opts.engines_per_gpu,
        idle_cleanup_step=opts.idle_cleanup_step,
        batch_wait_ms=opts.resolved_batch_wait_ms)


def remote_ranks(opts: VllmOptions) -> range:
    """The data-parallel ranks a head node leaves to ``--headless`` nodes (empty: all are here, or Ray places
    them)."""
    local = opts.data_parallel_size_local
    if opts.headless or local is None or opts.data_parallel_backend != "mp":
        return range(0)
    return range(local, opts.data_parallel_size)
