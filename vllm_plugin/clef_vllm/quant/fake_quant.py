"""Fake quantization of a live model: swap ``nn.Linear`` weights for their quantize-dequantize
images (and hook their inputs), then put everything back.

The offline quality tools (sensitivity scan, the GPU quality run) simulate a Hybrid checkpoint
on the reference backend with it; the numerics are :mod:`clef_vllm.quant.numerics`, the same
as the exported checkpoints.
"""

from __future__ import annotations

import torch

from clef_vllm.quant import numerics as N
from clef_vllm.quant.fused_scales import group_fused_shards


class FakeQuant:
    """Swap Linear weights for their quantize-dequantize images (and hook activations); undo restores.

    ``input_amax``: calibrated max |input| per module name, for W4A4 activation global scales.
    """

    def __init__(self, input_amax: dict[str, float] | None = None):
        self.saved: list[tuple[torch.nn.Linear, torch.Tensor]] = []
        self.hooks = []
        self.input_amax = input_amax or {}

    def nvfp4(self, modules: dict[str, torch.nn.Linear], activations: bool) -> None:
        """NVFP4 weights, fused shards (same leaf group) sharing one divisor; optional W4A4 inputs."""
        by_stem: dict[str, dict[str, torch.nn.Linear]] = {}
        for name, mod in modules.items():
            by_stem.setdefault(name.rsplit(".", 1)[0], {})[name] = mod
        for stem_modules in by_stem.values():
            fused = {}
            for _, shards in group_fused_shards(stem_modules):
                top = max(float(stem_modules[s].weight.abs().amax()) for s in shards)
                fused.update({s: top for s in shards})
            for name, mod in stem_modules.items():
                amax = fused.get(name, float(mod.weight.abs().amax()))
                self._set(mod, N.nvfp4_fake_quant(mod.weight.data, N.nvfp4_global_scale(amax, mod.weight.dtype)))
                if activations:
                    fused_in = max(self.input_amax.get(n, 0.0) for n in stem_modules if
                                   n == name or (n in fused and name in fused))
                    g = N.nvfp4_global_scale(fused_in or 1.0, mod.weight.dtype)
                    self.hooks.append(mod.register_forward_pre_hook(
                        lambda m, args, g=g: (N.nvfp4_fake_quant_activation(args[0], g),)))

    def fp8(self, modules: dict[str, torch.nn.Linear], activations: bool = True) -> None:
        """FP8 W8A8: per-channel weights, dynamic per-token activations."""
        for mod in modules.values():
            self._set(mod, N.fp8_fake_quant_weight(mod.weight.data))
            if activations:
                self.hooks.append(mod.register_forward_pre_hook(lambda m, args: (N.fp8_fake_quant_tokens(args[0]),)))

    def _set(self, mod, weight) -> None:
        self.saved.append((mod, mod.weight.data))
        mod.weight.data = weight

    def undo(self) -> None:
        for mod, weight in reversed(self.saved):
            mod.weight.data = weight
        for h in self.hooks:
            h.remove()
        self.saved, self.hooks = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()
