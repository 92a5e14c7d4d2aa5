"""NVFP4 layers as BF16 GEMMs on weights dequantized once at load (``--nvfp4-kernel bf16``).

Before Blackwell there is no FP4 arithmetic, and vLLM 0.28 runs an NVFP4 W4A4 layer as Marlin W4A16: the
activations stay BF16 and Marlin dequantizes the 4-bit weights inside its GEMM, every step. That is
weight-only compression, built for decoding's few rows. A Clef decision is one prefill of hundreds to
thousands of rows, where the GEMM is bound by its arithmetic, and there Marlin is slow: on one H200 the
9B-shaped Hybrid spent ~0.61 ms of Marlin per NVFP4 layer on a 400-token request against ~0.19 ms of
CUTLASS per FP8 layer (``bench/results/h200_latency_9b_hybrid_step.json``), and cuBLAS's BF16 GEMMs of a
9B layer take ~0.27-0.29 ms at 400 rows (``h200_gemm_sizes_bf16.json``, its per-layer times).

This kernel computes what Marlin computes, W4A16, with the dequantization moved to load time: each
NVFP4 weight becomes ``e2m1 · block scale · global scale`` in BF16 (the block scale FP8 E4M3 per 16
inputs, the global scale the one vLLM's scheme kept for the fused module: the inverse of the largest
divisor, as Marlin gets it), and a step runs ``F.linear`` on BF16 activations. The products of an E2M1
value and an E4M3 scale fit BF16 exactly; the global scale rounds each weight once to BF16 (Marlin
applies it inside its kernel), and cuBLAS accumulates in another order than Marlin: the answers agree
with Marlin's at the BF16 noise floor, not bit for bit. The cost is memory: 2 bytes a weight instead of
0.5625 (4 bits and an FP8 scale per 16), 3.6x: ~4.7 GB more for the 3.24 billion NVFP4 weights of the 9B
Hybrid's layers 17-31, taken from the KV cache.

vLLM picks an NVFP4 kernel per layer from a list in priority order (``_POSSIBLE_NVFP4_KERNELS``): when
the engine was started with the option (:attr:`clef_vllm.contract.WorkerSettings.nvfp4_kernel`), :func:`install`,
called from the model's constructor before its layers exist, puts the kernel (:func:`kernel_class`) first
in this process's list for its platform. Weight-only NVFP4 checkpoints (W4A16, which vLLM always gives
Marlin) and a ``--linear-backend`` (which filters the list) keep vLLM's choice; the options refuse ``bf16``
beside one, and ``auto`` yields to it (``VllmOptions.linear_backend_chosen``).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from clef_vllm.contract import NVFP4_KERNELS
from clef_vllm.quant.kernels import resolve_nvfp4_kernel
from clef_vllm.quant.numerics import nvfp4_dequantize

log = logging.getLogger("clef_vllm")


def dequantized_weight(layer: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The ``[N, K]`` weight of an NVFP4 layer as vLLM's scheme leaves it for its kernel: ``layer.weight``
    packed E2M1 (uint8 ``[N, K/2]``), ``layer.weight_scale`` FP8 E4M3 ``[N, K/16]`` and
    ``layer.weight_global_scale`` the multiplier (the inverse of compressed-tensors' divisor)."""
    return nvfp4_dequantize(layer.weight.data, layer.weight_scale.data, layer.weight_global_scale.data,
                            dtype, divisor=False)


@functools.cache
def kernel_class():
    """The kernel class, made once (it subclasses vLLM's, imported on first use)."""
    from vllm.model_executor.kernels.linear import NvFp4LinearKernel

    class Bf16NvFp4LinearKernel(NvFp4LinearKernel):
        """NVFP4 W4A4 checkpoint layers as BF16 GEMMs on weights dequantized at load: W4A16 numerics (see
        the module docstring)."""

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return True, None

        @classmethod
        def can_implement(cls, config) -> tuple[bool, str | None]:
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            weight = dequantized_weight(layer)
            layer.weight = torch.nn.Parameter(weight, requires_grad=False)
            # what only an FP4 kernel reads: freed now (the packed weight went with the assignment above)
            for name in ("weight_scale", "weight_global_scale", "input_global_scale", "input_global_scale_inv",
                         "alpha"):
                if hasattr(layer, name):
                    delattr(layer, name)

        def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
            weight = layer.weight
            return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)      # no copies when x is BF16

    return Bf16NvFp4LinearKernel


def install(choice: str) -> bool:
    """Make this process's NVFP4 layers use :class:`Bf16NvFp4LinearKernel` when ``choice`` is ``"bf16"`` (or
    ``"auto"`` on a GPU where vLLM's own would be Marlin: :func:`~clef_vllm.quant.kernels.resolve_nvfp4_kernel`),
    vLLM's own choice otherwise (idempotent either way). ``True`` when the BF16 kernel is first."""
    if choice not in NVFP4_KERNELS:
        raise ValueError(f"unknown NVFP4 kernel {choice!r}: one of {', '.join(NVFP4_KERNELS)}")
    asked = choice
    from vllm.model_executor.kernels import linear
    from vllm.platforms import current_platform

    if choice == "auto":
        capability = current_platform.get_device_capability() if current_platform.is_cuda() else None
        choice = resolve_nvfp4_kernel("auto", None if capability is None else tuple(capability))

    registry = getattr(linear, "_POSSIBLE_NVFP4_KERNELS", None)
    if registry is None:                # another vLLM than 0.28: its own choice, unless asked otherwise
        if asked == "bf16":
            raise RuntimeError("--nvfp4-kernel bf16 needs vLLM 0.28's NVFP4 kernel list (_POSSIBLE_NVFP4_KERNELS)")
        return False
    # the list vLLM's init_nvfp4_linear_kernel reads for this platform (CUDA on the GPU, CPU in the tests)
    kernels = registry.setdefault(current_platform._enum, [])
    cls = kernel_class()
    kernels[:] = [k for k in kernels if k is not cls]
    if choice == "bf16":
        kernels.insert(0, cls)
        log.info("clef NVFP4 layers: BF16 GEMMs on weights dequantized at load (--nvfp4-kernel %s: W4A16 "
                 "numerics, 3.6x the packed weights' memory)", asked)
        return True
    return False
