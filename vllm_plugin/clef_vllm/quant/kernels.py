"""Which vLLM 0.28 scheme class and GEMM kernel a quantization scheme gets on a CUDA capability.

The only part of :mod:`clef_vllm.quant` that serving needs: the server's front-end logs this
prediction per scheme at start-up, and each worker logs what it actually instantiated
(:func:`kernel_report`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from clef_vllm.quant.schemes import FP8_W8A8, FP8_W8A16, NVFP4_W4A4, NVFP4_W4A16, UNQUANTIZED


@dataclass(frozen=True)
class KernelPrediction:
    """What vLLM 0.28 runs for one scheme on one GPU."""

    kind: str
    scheme_class: str          # CompressedTensorsW8A8Fp8 / CompressedTensorsW4A4Fp4 / UnquantizedLinearMethod
    kernel: str                # the GEMM kernel class vLLM selects first
    numerics: str              # what is actually computed, e.g. "W4A16 (weights only)"
    description: str           # one line for logs
    supported: bool = True


def parse_capability(capability) -> tuple[int, int]:
    """``(9, 0)``, ``"9.0"``, ``9.0``, ``90`` or ``"sm_90"`` -> ``(9, 0)``."""
    if isinstance(capability, tuple):
        return int(capability[0]), int(capability[1])
    text = str(capability).lower().removeprefix("sm_").removeprefix("sm")
    if "." in text:
        major, minor = text.split(".", 1)
        return int(major), int(minor[:1] or 0)
    value = int(text)
    return (value // 10, value % 10) if value >= 10 else (value, 0)


def gpu_family(capability) -> str:
    major, minor = parse_capability(capability)
    return {7: "Turing/Volta", 8: "Ada" if minor >= 9 else "Ampere", 9: "Hopper", 10: "Blackwell",
            11: "Blackwell", 12: "Blackwell (consumer)"}.get(major, f"SM{major}{minor}")


#: The first compute capability with native NVFP4 W4A4 GEMMs (Blackwell); below it vLLM runs them as Marlin W4A16.
NATIVE_FP4_MAJOR = 10


def resolve_nvfp4_kernel(choice: str, capability) -> str:
    """``--nvfp4-kernel`` as the kernel it means on a GPU of ``capability`` (``None``: no CUDA GPU): ``"auto"``
    is ``"bf16"`` where vLLM's own NVFP4 W4A4 kernel is Marlin W4A16 (SM75 up to Blackwell, where the BF16 GEMMs
    keep Marlin's numerics and are faster at prefill sizes) and ``"vllm"`` elsewhere; other choices are themselves."""
    if choice != "auto":
        return choice
    if capability is None:
        return "vllm"
    major, minor = parse_capability(capability)
    return "bf16" if 75 <= major * 10 + minor and major < NATIVE_FP4_MAJOR else "vllm"


def predict_kernel(kind: str, capability, *, linear_backend: str = "auto", flashinfer: bool = True,
                   nvfp4_kernel: str = "vllm") -> KernelPrediction:
    """The scheme class and GEMM kernel vLLM 0.28 picks for ``kind`` on a CUDA ``capability``.

    Follows ``init_fp8_linear_kernel`` / ``init_nvfp4_linear_kernel`` (docs/vllm-internals.md,
    "Kernels"): FP8 W8A8
    per-channel + dynamic per-token -> CUTLASS on SM89+; NVFP4 -> Marlin W4A16 below SM100,
    FlashInfer/CUTLASS native W4A4 on SM100+. ``linear_backend="emulation"`` forces the NVFP4
    emulation kernel (true W4A4 numerics, slow). ``flashinfer``: whether FlashInfer is installed.
    ``nvfp4_kernel="bf16"`` (``--nvfp4-kernel``) puts the plugin's kernel before vLLM's for NVFP4 W4A4 layers:
    BF16 GEMMs on weights dequantized at load (:mod:`clef_vllm.worker.fast.nvfp4_bf16`); ``"auto"`` does so where
    vLLM's own would be Marlin (:func:`resolve_nvfp4_kernel`).
    """
    cap = parse_capability(capability)
    num = cap[0] * 10 + cap[1]
    family = f"{gpu_family(cap)} GPU (SM{num})"
    asked, nvfp4_kernel = nvfp4_kernel, resolve_nvfp4_kernel(nvfp4_kernel, cap)
    if kind == UNQUANTIZED:
        return KernelPrediction(kind, "UnquantizedLinearMethod", "torch/cuBLAS GEMM", "BF16",
                                f"unquantized layers run as BF16 GEMMs on this {family}")
    if kind in (FP8_W8A8, FP8_W8A16):
        if num < 75:
            return KernelPrediction(kind, "-", "-", "-", f"FP8 is not supported on SM{num} (needs SM75+)", False)
        if kind == FP8_W8A8 and num >= 89:
            return KernelPrediction(kind, "CompressedTensorsW8A8Fp8", "CutlassFP8ScaledMMLinearKernel", "W8A8 FP8",
                                    f"FP8 W8A8 runs natively (CUTLASS, dynamic per-token FP8 activations) on this {family}")
        return KernelPrediction(kind, "CompressedTensorsW8A16Fp8", "MarlinFP8ScaledMMLinearKernel",
                                "W8A16 (weights only)",
                                f"FP8 runs as Marlin W8A16 (weights only, BF16 activations) on this {family}")
    if kind in (NVFP4_W4A4, NVFP4_W4A16):
        if num < 75:
            return KernelPrediction(kind, "-", "-", "-", f"NVFP4 is not supported on SM{num} (needs SM75+)", False)
        cls = "CompressedTensorsW4A4Fp4"
        if linear_backend == "emulation":
            return KernelPrediction(kind, cls, "EmulationNvFp4LinearKernel",
                                    "W4A4 (emulated)" if kind == NVFP4_W4A4 else "W4A16 (emulated)",
                                    f"NVFP4 runs through the emulation kernel (true FP4 numerics, slow) on this {family}")
        if kind == NVFP4_W4A4 and nvfp4_kernel == "bf16":
            return KernelPrediction(kind, cls, "Bf16NvFp4LinearKernel", "W4A16 (weights dequantized to BF16)",
                                    f"NVFP4 W4A4 runs as BF16 GEMMs on weights dequantized at load (--nvfp4-kernel "
                                    f"{asked}; BF16 activations, the input global scale unused) on this {family}")
        if kind == NVFP4_W4A4 and cap[0] in (10, 11):
            kernel = "FlashInferCuteDslNvFp4LinearKernel" if flashinfer else "CutlassNvFp4LinearKernel"
            return KernelPrediction(kind, cls, kernel, "W4A4",
                                    f"NVFP4 W4A4 runs natively ({'FlashInfer' if flashinfer else 'CUTLASS'}, "
                                    f"FP4 activations with the calibrated input global scale) on this {family}")
        if kind == NVFP4_W4A4 and cap[0] >= 12:
            kernel = "FlashInferCutlassNvFp4LinearKernel" if flashinfer else "CutlassNvFp4LinearKernel"
            return KernelPrediction(kind, cls, kernel, "W4A4",
                                    f"NVFP4 W4A4 runs natively ({'FlashInfer-CUTLASS' if flashinfer else 'CUTLASS'}) "
                                    f"on this {family}")
        what = "NVFP4 W4A4" if kind == NVFP4_W4A4 else "NVFP4 W4A16"
        return KernelPrediction(kind, cls, "MarlinNvFp4LinearKernel", "W4A16 (weights only)",
                                f"{what} runs as Marlin W4A16 (weights only, BF16 activations; the input global "
                                f"scale is unused) on this {family}")
    return KernelPrediction(kind, "?", "?", "?", f"scheme {kind} is outside the Hybrid recipe; not predicted", False)


def cuda_capability() -> tuple[int, int] | None:
    """This machine's first CUDA device capability, or None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(0))


def kernel_report(model) -> list[str]:
    """What the worker actually runs per linear module: ``scheme -> GEMM kernel x count``.

    On Hopper an NVFP4 W4A4 checkpoint shows ``MarlinNvFp4LinearKernel``: weight-only W4A16.
    """
    from vllm.model_executor.layers.linear import LinearBase

    counts: dict[str, int] = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or not isinstance(module, LinearBase):
            continue
        scheme = getattr(module, "scheme", None)
        owner = scheme if scheme is not None else method
        kernel = getattr(owner, "kernel", None) or getattr(owner, "fp8_linear", None)
        label = type(owner).__name__ + (f" -> {type(kernel).__name__}" if kernel is not None else "")
        counts[label] = counts.get(label, 0) + 1
    lines = [f"{label} x{n}" for label, n in sorted(counts.items())]
    if any("MarlinNvFp4" in line for line in lines):
        lines.append("NVFP4 W4A4 layers run as Marlin W4A16 on this GPU: weights only, activations stay BF16 "
                     "(no native FP4 before Blackwell), and at prefill sizes ~3x slower per layer than FP8 W8A8 "
                     "(measured on an H200: docs/latency.md; --nvfp4-kernel vllm or a --linear-backend chose this; the "
                     "default, auto, dequantizes them at load instead)")
    if any("Bf16NvFp4" in line for line in lines):
        lines.append("NVFP4 W4A4 layers run as BF16 GEMMs on weights dequantized at load (--nvfp4-kernel bf16/auto): "
                     "W4A16 numerics, activations stay BF16, the weights take 3.6x their packed memory")
    mode = os.environ.get("CUDA_MODULE_LOADING", "LAZY").upper()
    lines.append(f"CUDA loads kernels {'eagerly' if mode == 'EAGER' else 'lazily'} in this process "
                 f"(CUDA_MODULE_LOADING={mode})")
    return lines
