"""How :class:`~clef_vllm.backends.options.VllmOptions` fields reach vLLM: each function here takes the options
and adds what one field derives to the keywords of ``vllm.AsyncEngineArgs`` (engine settings, and the worker
settings of :mod:`clef_vllm.contract` carried in ``additional_config``). A field names its function with
``engine=`` in its declaration; :func:`clef_vllm.backends.options.engine_args` calls them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from clef_vllm.contract import (BATCH_WAIT_KEY, CLEF_WORKER, ENGINES_PER_GPU_KEY, GDN_MEMO_KEY, GDN_TUNING_KEY,
                                GEMM_ROW_GRID_KEY, GEMM_WARMUP_KEY, HEAD_DTYPE_KEY, HEAD_GRAPHS_KEY, IDLE_CLEANUP_KEY,
                                NVFP4_KERNEL_KEY, PREFILL_GRAPHS_KEY, SCHEDULER_CLASSES, SHARED_GPU_WORKER,
                                STATE_CACHE_KEY, tell_worker)

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
    kwargs["worker_cls"] = CLEF_WORKER
    if opts.engines_per_gpu > 1:
        tell_worker(kwargs, ENGINES_PER_GPU_KEY, opts.engines_per_gpu)
        kwargs["worker_cls"] = SHARED_GPU_WORKER


def head_dtype_config(opts: VllmOptions, kwargs: dict) -> None:
    tell_worker(kwargs, HEAD_DTYPE_KEY, opts.resolved_head_dtype)


def prefill_graphs(opts: VllmOptions, kwargs: dict) -> None:
    """The worker's GDN prefill graphs (:mod:`clef_vllm.worker.fast.prefill_graphs`) per padded bucket up to
    the step's token budget, and vLLM's piecewise CUDA graphs captured up to the same token counts."""
    if not opts.prefill_graphs:
        return
    from clef_vllm.worker.fast.prefill_graphs import DEFAULT_BUCKETS, cudagraph_capture_sizes

    budget = kwargs["max_num_batched_tokens"]
    # engine_kwargs has filled in the checkpoint's defaults (prefill_graphs.default_buckets); options alone,
    # with no checkpoint to read, get the generic list
    buckets = [b for b in (opts.prefill_graph_buckets or DEFAULT_BUCKETS) if b <= budget]
    scope = opts.resolved_prefill_graph_scope
    setting = {"buckets": buckets, "scope": scope}
    if scope == "step":
        setting["split"] = opts.step_graph_split
    tell_worker(kwargs, PREFILL_GRAPHS_KEY, setting)
    if not opts.enforce_eager:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": cudagraph_capture_sizes(
            budget, buckets, kwargs["max_num_seqs"], between_buckets=scope != "step")}


def gdn_memo(opts: VllmOptions, kwargs: dict) -> None:
    """The GDN metadata memo of single-prefill steps (:mod:`clef_vllm.worker.fast.gdn_metadata`) is on unless
    the worker is told otherwise."""
    if not opts.gdn_metadata_memo:
        tell_worker(kwargs, GDN_MEMO_KEY, False)


def gdn_tuning(opts: VllmOptions, kwargs: dict) -> None:
    """The GDN prefill's Triton kernels tuned per shape class at start-up (:mod:`clef_vllm.worker.fast.gdn_tuning`)."""
    if opts.gdn_tuning:
        tell_worker(kwargs, GDN_TUNING_KEY, True)


def nvfp4_kernel(opts: VllmOptions, kwargs: dict) -> None:
    """NVFP4 layers as BF16 GEMMs on weights dequantized at load (:mod:`clef_vllm.worker.fast.nvfp4_bf16`) when
    asked (``auto``: the worker decides by its GPU), vLLM's own kernel otherwise and whenever
    ``--linear-backend`` chooses."""
    if opts.nvfp4_kernel != "vllm" and not opts.linear_backend_chosen:
        tell_worker(kwargs, NVFP4_KERNEL_KEY, opts.nvfp4_kernel)


def gemm_warmup(opts: VllmOptions, kwargs: dict) -> None:
    """The head's GEMM kernels loaded at the first step (:mod:`clef_vllm.worker.fast.gemm_warmup`) unless turned off."""
    if opts.gemm_warmup:
        tell_worker(kwargs, GEMM_WARMUP_KEY, {"rows": opts.gemm_warmup_rows} if opts.gemm_warmup_rows else True)
        if opts.gemm_row_grid:
            tell_worker(kwargs, GEMM_ROW_GRID_KEY, True)


def head_graphs(opts: VllmOptions, kwargs: dict) -> None:
    """The worker's joint-head CUDA graphs (:mod:`clef_vllm.worker.fast.head_graphs`) for steps finishing up to
    ``head_graph_records`` requests."""
    if opts.head_graphs:
        tell_worker(kwargs, HEAD_GRAPHS_KEY, {"records": opts.head_graph_records})


def state_cache(opts: VllmOptions, kwargs: dict) -> None:
    """vLLM's prefix caching (align mode) plus the memory rows of cached prefixes in the worker
    (:mod:`clef_vllm.worker.fast.state_cache`); the scheduler (always ours) keeps the two consistent."""
    kwargs["enable_prefix_caching"] = opts.state_cache
    if not opts.state_cache:
        return
    if opts.state_cache_match == "unit":
        from clef_vllm.schema.state_keys import KEY_UNIT

        kwargs.update(prefix_match_unit=KEY_UNIT)   # hits and GDN states at the state's end, not at a block's
    tell_worker(kwargs, STATE_CACHE_KEY, {"on": True})


def scheduling(opts: VllmOptions, kwargs: dict) -> None:
    """Always our scheduler (a context-filling prompt finishes: its rule 0), on vLLM's synchronous
    ``Scheduler`` or, with ``async_scheduling``, on its ``AsyncScheduler``: the engine core then schedules
    and prepares the next step while the GPU runs the current one (vLLM 0.28 leaves that off for pooling
    models unless asked; docs/latency.md, "Async scheduling")."""
    kwargs["async_scheduling"] = opts.async_scheduling
    kwargs["scheduler_cls"] = SCHEDULER_CLASSES[opts.async_scheduling]


def batch_wait(opts: VllmOptions, kwargs: dict) -> None:
    """The scheduler's rule 5: an idle engine may hold a few new requests up to this long to batch them."""
    if opts.resolved_batch_wait_ms:
        tell_worker(kwargs, BATCH_WAIT_KEY, opts.resolved_batch_wait_ms)


def data_parallel_backend(opts: VllmOptions, kwargs: dict) -> None:
    """vLLM's ``data_parallel_backend``, given only when it is not vLLM's default (``mp``)."""
    if opts.data_parallel_backend != "mp":
        kwargs["data_parallel_backend"] = opts.data_parallel_backend


def idle_cleanup(opts: VllmOptions, kwargs: dict) -> None:
    """vLLM's engine step that only drops finished requests, kept when asked (the scheduler's rule 4)."""
    if opts.idle_cleanup_step:
        tell_worker(kwargs, IDLE_CLEANUP_KEY, True)


def remote_ranks(opts: VllmOptions) -> range:
    """The data-parallel ranks a head node leaves to ``--headless`` nodes (empty: all are here, or Ray places
    them)."""
    local = opts.data_parallel_size_local
    if opts.headless or local is None or opts.data_parallel_backend != "mp":
        return range(0)
    return range(local, opts.data_parallel_size)
