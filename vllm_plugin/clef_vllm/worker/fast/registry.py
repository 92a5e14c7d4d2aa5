"""The worker's speed features, one module each in :mod:`clef_vllm.worker.fast`, and the only door through
which the model class (:mod:`clef_vllm.worker.model`) reaches them.

Each feature is switched by the worker setting the front-end sends (:mod:`clef_vllm.contract`); with its
setting off, the model runs vLLM's own path. :data:`FEATURES` lists them: feature -> (module, setting).
A new speed feature is a new module here, a setting in :mod:`clef_vllm.contract` and its flag in
:mod:`clef_vllm.backends.options`, and a line in :data:`FEATURES`; the model class imports it from this module.
"""

from __future__ import annotations

from clef_vllm.contract import (BATCH_WAIT_KEY, ENGINES_PER_GPU_KEY, GDN_MEMO_KEY, GDN_TUNING_KEY, GEMM_WARMUP_KEY,
                                HEAD_GRAPHS_KEY, NVFP4_KERNEL_KEY, PREFILL_GRAPHS_KEY, STATE_CACHE_KEY)
from clef_vllm.worker.fast import gdn_metadata, gdn_tuning, nvfp4_bf16
from clef_vllm.worker.fast.head_graphs import HeadGraphRunner
from clef_vllm.worker.fast.prefill_graphs import DEFAULT_BUCKETS, GdnGraphRunner, triton_gdn
from clef_vllm.worker.fast.step_graphs import SPLIT_TOKENS, StepGraphRunner

#: Every speed feature: name -> (its module in this package, the worker setting that switches it).
FEATURES = {
    "batch_wait": ("batch_wait", BATCH_WAIT_KEY),              # the scheduler waits for a fuller batch
    "gdn_metadata": ("gdn_metadata", GDN_MEMO_KEY),            # GDN attention metadata memoized per shape
    "gdn_tuning": ("gdn_tuning", GDN_TUNING_KEY),              # GDN Triton kernels tuned at load
    "gemm_warmup": ("gemm_warmup", GEMM_WARMUP_KEY),           # the head's GEMMs warmed up at load
    "head_graphs": ("head_graphs", HEAD_GRAPHS_KEY),           # the joint head as CUDA graphs
    "nvfp4_bf16": ("nvfp4_bf16", NVFP4_KERNEL_KEY),            # NVFP4 weights dequantized to BF16 GEMMs
    "prefill_graphs": ("prefill_graphs", PREFILL_GRAPHS_KEY),  # GDN prefill as CUDA graphs per bucket
    "step_graphs": ("step_graphs", PREFILL_GRAPHS_KEY),        # whole steps of a few sequences as graphs
    "state_cache": ("state_cache", STATE_CACHE_KEY),           # decided states kept for follow-up requests
    "shared_gpu": ("shared_gpu", ENGINES_PER_GPU_KEY),         # several engines placed on one GPU
}

__all__ = ["DEFAULT_BUCKETS", "FEATURES", "SPLIT_TOKENS", "GdnGraphRunner", "HeadGraphRunner", "StepGraphRunner",
           "gdn_metadata", "gdn_tuning", "nvfp4_bf16", "triton_gdn"]
