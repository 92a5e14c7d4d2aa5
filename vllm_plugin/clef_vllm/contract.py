"""What the vLLM backend (front-end) and the plugin's worker code agree on; imports nothing.

The front-end (:mod:`clef_vllm.backends.vllm_backend`) sends every request as
``PoolingParams(task=POOLING_TASK, extra_kwargs={PARAMS_KEY: HeadSpec.to_wire()})`` and starts the
engine with ``additional_config={HEAD_DTYPE_KEY: "bfloat16" | "float32", ...}`` (plus the
prefill-graph, head-graph and state-cache settings below when they are on); the worker (:mod:`clef_vllm.worker`)
reads exactly these names. Both sides import them from here (the engine side through
:mod:`clef_vllm.backends.options`), and each side goes through one function: :func:`tell_worker` and
:func:`worker_setting`.
"""

#: vLLM pooling task served by :class:`clef_vllm.worker.pooler.ClefPooler` (vLLM's task for a
#: model-defined pooler; ``PoolingParams.verify`` leaves its params alone).
POOLING_TASK = "plugin"
#: Key of the per-request head spec in ``PoolingParams.extra_kwargs`` (plain lists: msgpack-safe).
PARAMS_KEY = "clef"
#: Key of the joint head's dtype in vLLM's ``additional_config`` (read by every worker).
HEAD_DTYPE_KEY = "clef_head_dtype"
#: Values ``HEAD_DTYPE_KEY`` may take.
HEAD_DTYPES = ("bfloat16", "float32")
#: ``additional_config`` key: ``{"buckets": [...], "scope": ..., "split": N}`` turns on the GDN prefill graphs
#: (absent: off).
PREFILL_GRAPHS_KEY = "clef_prefill_graphs"
#: What a prefill graph holds (``--prefill-graph-scope``): the GDN core, vLLM's whole packed GDN op, or the
#: whole backbone of a single-sequence step (over the core graphs).
PREFILL_GRAPH_SCOPES = ("core", "layer", "step")
#: ``--step-graph-split``'s default: with whole-step graphs, a step of up to this many prefill sequences replays each
#: one's step graph in turn (the ``"split"`` entry of the PREFILL_GRAPHS_KEY setting; absent or below 2: never).
DEFAULT_STEP_GRAPH_SPLIT = 4
#: ``additional_config`` key: ``{"records": N}`` turns on the joint head's CUDA graphs for steps finishing up
#: to N requests (absent: off).
HEAD_GRAPHS_KEY = "clef_head_graphs"
#: The values N may take: the record buckets (a step finishing R requests is padded to the smallest >= R).
HEAD_GRAPH_RECORDS = (1, 2, 4, 8, 16, 32, 64)
#: vLLM's ``scheduler_cls`` for Clef engines, by ``--async-scheduling`` (off / on): the same rules, on vLLM's
#: synchronous ``Scheduler`` or its ``AsyncScheduler`` (:mod:`clef_vllm.worker.scheduler`).
SCHEDULER_CLASSES = {False: "clef_vllm.worker.scheduler.ClefScheduler",
                     True: "clef_vllm.worker.scheduler.ClefAsyncScheduler"}
#: ``additional_config`` key: present (a dict) when the state cache is on (prefix caching + side rows).
STATE_CACHE_KEY = "clef_state_cache"
#: ``additional_config`` key: ``True`` keeps vLLM's engine step that only drops finished requests from the
#: workers once no request is left (``--idle-cleanup-step on``; absent: the next scheduled step drops them).
IDLE_CLEANUP_KEY = "clef_idle_cleanup_step"
#: ``additional_config`` key: milliseconds an idle engine may hold new requests to batch them
#: (``--batch-wait-ms``; absent: none).
BATCH_WAIT_KEY = "clef_batch_wait_ms"
#: ``additional_config`` key: ``True`` (or ``{"rows": N}``: up to N rows) has the first step that reaches the joint
#: head run its GEMM shapes over a grid of row counts, so CUDA loads their kernels then (``--gemm-warmup``, on by
#: default; absent: off).
GEMM_WARMUP_KEY = "clef_gemm_warmup"
#: ``additional_config`` key: ``True`` has the worker run the head's eager GEMMs at the warm-up grid's row counts
#: once the warm-up has run (``--gemm-row-grid``, on by default; absent: off).
GEMM_ROW_GRID_KEY = "clef_gemm_row_grid"
#: ``additional_config`` key: ``False`` turns off the GDN metadata memo of single-prefill steps
#: (``--gdn-metadata-memo off``; absent: on).
GDN_MEMO_KEY = "clef_gdn_metadata_memo"
#: ``additional_config`` key: ``True`` has the worker autotune the GDN prefill's Triton kernels per shape class at
#: its first forward (``--gdn-tuning``, on by default; absent: vLLM's one tuning at 64 tokens).
GDN_TUNING_KEY = "clef_gdn_tuning"
#: ``additional_config`` key: ``"bf16"`` runs NVFP4 layers as BF16 GEMMs on weights dequantized at load,
#: ``"auto"`` does so where vLLM's own kernel would be Marlin W4A16 (``--nvfp4-kernel``; absent: vLLM's own NVFP4 kernel).
NVFP4_KERNEL_KEY = "clef_nvfp4_kernel"
#: ``--nvfp4-kernel`` values: vLLM's own choice (Marlin W4A16 before Blackwell, native W4A4 from it), BF16
#: GEMMs on weights dequantized at load, or ``auto``: BF16 GEMMs before Blackwell, vLLM's choice from it
#: (:func:`clef_vllm.quant.kernels.resolve_nvfp4_kernel`).
NVFP4_KERNELS = ("vllm", "bf16", "auto")
#: ``--nvfp4-kernel``'s default, for the server and for ``clef-load``'s prediction of it.
DEFAULT_NVFP4_KERNEL = "auto"
#: ``additional_config`` key: how many data-parallel engines share each GPU (``--engines-per-gpu``; absent: one).
ENGINES_PER_GPU_KEY = "clef_engines_per_gpu"
#: vLLM's ``worker_cls`` for a Clef engine: vLLM's GPU worker, with the plugin's memory taken out of the KV cache
#: and the allocator capped at the budget (:mod:`clef_vllm.worker.budget`).
CLEF_WORKER = "clef_vllm.worker.budget.ClefWorker"
#: vLLM's ``worker_cls`` for engines that share a GPU: it places them and starts them one at a time
#: (:mod:`clef_vllm.worker.fast.shared_gpu`).
SHARED_GPU_WORKER = "clef_vllm.worker.fast.shared_gpu.SharedGpuWorker"


def tell_worker(engine_kwargs: dict, key: str, value) -> None:
    """Put the worker setting ``key`` into the engine arguments' ``additional_config``."""
    engine_kwargs.setdefault("additional_config", {})[key] = value


def worker_setting(vllm_config, key: str, default=None):
    """The worker setting ``key`` from a ``VllmConfig`` (its ``additional_config`` may be ``None``)."""
    return (vllm_config.additional_config or {}).get(key, default)
