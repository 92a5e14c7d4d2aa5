"""NVFP4 and FP8 numerics in plain torch: what compressed-tensors writes and what vLLM computes.

E2M1 rounding and packing, compressed-tensors' scale formulas, quantize / dequantize /
fake-quant (no torch.compile). The native exporter of ``clef-quantize-mixed``, the fused-scale
fix, the sensitivity scan and :class:`clef_vllm.quant.fake_quant.FakeQuant` use them, so offline
simulations compute exactly what an exported checkpoint holds.
"""

from __future__ import annotations

import torch

FP4_MAX = 6.0
FP8_MAX = 448.0
NVFP4_GROUP = 16
# E2M1 magnitudes by code (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the E2M1 grid {0, ±0.5, …, ±6} with compressed-tensors' tie rules (ties to even), clamping at ±6."""
    a = x.abs().float()
    out = torch.zeros_like(a)
    out = torch.where((a > 0.25) & (a < 0.75), 0.5, out)
    out = torch.where((a >= 0.75) & (a <= 1.25), 1.0, out)
    out = torch.where((a > 1.25) & (a < 1.75), 1.5, out)
    out = torch.where((a >= 1.75) & (a <= 2.5), 2.0, out)
    out = torch.where((a > 2.5) & (a < 3.5), 3.0, out)
    out = torch.where((a >= 3.5) & (a <= 5.0), 4.0, out)
    out = torch.where(a > 5.0, 6.0, out)
    return out * torch.sign(x.float())


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """E2M1-grid values ``[N, K]`` -> uint8 ``[N, K/2]`` (two codes per byte, low nibble first)."""
    a = values.abs().float()
    grid = torch.tensor(E2M1_VALUES, device=values.device)
    code = (a.unsqueeze(-1) - grid).abs().argmin(-1)
    code = code | (torch.signbit(values.float()).long() << 3)
    code = code.reshape(values.shape[0], -1, 2)
    return (code[..., 0] | (code[..., 1] << 4)).to(torch.uint8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` -> float32 E2M1 values ``[N, K]``."""
    p = packed.to(torch.int32)
    codes = torch.stack((p & 0x0F, (p >> 4) & 0x0F), dim=-1).reshape(packed.shape[0], -1)
    grid = torch.tensor(E2M1_VALUES, device=packed.device)
    return grid[codes & 0x07] * torch.where((codes & 0x08) > 0, -1.0, 1.0)


def nvfp4_global_scale(amax: torch.Tensor | float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """compressed-tensors' global scale, a divisor: ``448·6 / amax`` computed in ``dtype`` (the
    observer works in the model dtype, hence BF16-representable values), returned as float32 [1]."""
    amax = torch.as_tensor(amax).to(dtype).reshape(1).clamp_min(torch.finfo(dtype).tiny)
    g = ((FP8_MAX * FP4_MAX) / amax).float()   # same expression (and CPU rounding) as compressed-tensors
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def nvfp4_group_scales(weight: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """FP8-E4M3 group scales ``[N, K/16]``: ``fp8(amax16 / 6 · g)``, zeros replaced by 0.125 (as compressed-tensors)."""
    # compressed-tensors computes amax/6 in the model dtype (the observer's), then scales in fp32.
    dtype = weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) else torch.float32
    amax = weight.reshape(weight.shape[0], -1, NVFP4_GROUP).abs().amax(-1).to(dtype)
    s = (amax / FP4_MAX).float() * global_scale.float().reshape(())
    s = s.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.where(s.float() == 0, torch.tensor(0.125, dtype=torch.float8_e4m3fn, device=s.device), s)


def nvfp4_quantize(weight: torch.Tensor, global_scale: torch.Tensor | None = None):
    """NVFP4 weight export: ``(weight_packed uint8 [N,K/2], weight_scale fp8 [N,K/16], weight_global_scale fp32 [1])``.

    ``global_scale`` (a divisor) defaults to the tensor's own ``448·6/amax``; pass a shared one for
    fused shards. Dequantization is ``w = q · s / g``.
    """
    if weight.dim() != 2 or weight.shape[1] % NVFP4_GROUP:
        raise ValueError(f"NVFP4 needs a 2-D weight with K divisible by {NVFP4_GROUP}, got {tuple(weight.shape)}")
    if global_scale is None:
        global_scale = nvfp4_global_scale(weight.abs().amax(), weight.dtype if weight.is_floating_point() else torch.float32)
    global_scale = global_scale.float().reshape(1).to(weight.device)
    scale = nvfp4_group_scales(weight, global_scale)
    eff = (scale.float() / global_scale).unsqueeze(-1)
    q = e2m1_round(weight.float().reshape(weight.shape[0], -1, NVFP4_GROUP) / eff).reshape(weight.shape)
    return pack_e2m1(q), scale, global_scale


def nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32, *, divisor: bool = True) -> torch.Tensor:
    """``q · s / g`` as ``[N, K]`` in ``dtype``: ``g`` compressed-tensors' global scale, a divisor; with
    ``divisor=False`` ``global_scale`` is the multiplier vLLM keeps after loading (``1 / g``): ``q · s · m``."""
    q = unpack_e2m1(packed)
    g = global_scale.float().reshape(())
    s = (scale.float() / g if divisor else scale.float() * g).repeat_interleave(NVFP4_GROUP, dim=1)
    return (q * s).to(dtype)


def nvfp4_fake_quant(weight: torch.Tensor, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize a weight through NVFP4, in the weight's dtype."""
    packed, scale, g = nvfp4_quantize(weight, global_scale)
    return nvfp4_dequantize(packed, scale, g, weight.dtype)


def nvfp4_fake_quant_activation(x: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    """W4A4 activations: dynamic FP8 scales per 16 inputs under a static (calibrated) global divisor."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    return nvfp4_fake_quant(flat, input_global_scale.to(x.device)).reshape(shape)


def fp8_quantize_channel(weight: torch.Tensor, scale_dtype: torch.dtype | None = None):
    """FP8-E4M3 per-output-channel weights: ``(weight fp8 [N,K], weight_scale [N,1])``; ``w ≈ q · s``.

    The scale is ``amax_row / 448`` rounded to ``scale_dtype`` (default: the weight's dtype, as
    compressed-tensors stores it).
    """
    scale_dtype = scale_dtype or (weight.dtype if weight.is_floating_point() else torch.float32)
    scale = (weight.abs().amax(dim=1, keepdim=True).to(scale_dtype) / FP8_MAX)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(scale_dtype).eps, dtype=scale_dtype, device=scale.device),
                        scale)
    # compressed-tensors divides in the weight's dtype (a BF16 rounding before the FP8 one); match it.
    work = weight if weight.is_floating_point() else weight.float()
    q = (work / scale.to(work.dtype)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_fake_quant_weight(weight: torch.Tensor) -> torch.Tensor:
    q, s = fp8_quantize_channel(weight)
    return (q.float() * s.float()).to(weight.dtype)


def fp8_fake_quant_tokens(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token FP8 activations (what CUTLASS W8A8 does to the input), in x's dtype."""
    s = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return ((x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).to(x.dtype)
