"""The worker's speed features, one module each in :mod:`clef_vllm.worker.fast`, and the only door through
which the model class (:mod:`clef_vllm.worker.model`) reaches them.

Each feature is switched by a field of the :class:`~clef_vllm.contract.WorkerSettings` the front-end sends; with
it off, the model runs vLLM's own path. :data:`FEATURES` lists them: feature -> (module, settings field).
A new speed feature is a new module here, a field of :class:`~clef_vllm.contract.WorkerSettings`, its option in
:mod:`clef_vllm.backends.options` (set into the settings by :func:`clef_vllm.backends.engine_settings.worker_settings`),
and a line in :data:`FEATURES`; the model class imports it from this module.
"""

from __future__ import annotations

from clef_vllm.worker.fast import gdn_metadata, gdn_tuning, nvfp4_bf16
from clef_vllm.worker.fast.head_graphs import HeadGraphRunner
from clef_vllm.worker.fast.prefill_graphs import DEFAULT_BUCKETS, GdnGraphRunner, triton_gdn
from clef_vllm.worker.fast.step_graphs import SPLIT_TOKENS, StepGraphRunner

#: Every speed feature: name -> (its module in this package, the WorkerSettings field that switches it).
FEATURES = {
    "batch_wait": ("batch_wait", "batch_wait_ms"),                # the scheduler waits for a fuller batch
    "gdn_metadata": ("gdn_metadata", "gdn_metadata_memo"),        # GDN attention metadata memoized per shape
    "gdn_tuning": ("gdn_tuning", "gdn_tuning"),                   # GDN Triton kernels tuned at load
    "gemm_warmup": ("gemm_warmup", "gemm_warmup"),                # the head's GEMMs warmed up at load
    "head_graphs": ("head_graphs", "head_graph_records"),         # the joint head as CUDA graphs
    "nvfp4_bf16": ("nvfp4_bf16", "nvfp4_kernel"),                 # NVFP4 weights dequantized to BF16 GEMMs
    "prefill_graphs": ("prefill_graphs", "prefill_graphs"),       # GDN prefill as CUDA graphs per bucket
    "step_graphs": ("step_graphs", "prefill_graphs"),             # whole steps of a few sequences as graphs
    "state_cache": ("state_cache", "state_cache"),                # decided states kept for follow-up requests
    "shared_gpu": ("shared_gpu", "engines_per_gpu"),              # several engines placed on one GPU
}

__all__ = ["DEFAULT_BUCKETS", "FEATURES", "SPLIT_TOKENS", "GdnGraphRunner", "HeadGraphRunner", "StepGraphRunner",
           "gdn_metadata", "gdn_tuning", "nvfp4_bf16", "triton_gdn"]
