"""``--load-format clef-dummy``: vLLM's dummy weights, with a quantized checkpoint's scales made tame.

vLLM's ``dummy`` load format fills every floating-point parameter with uniform values in [-1e-3, 1e-3]
and leaves integer ones as allocated. An unquantized backbone then answers finitely. A compressed-tensors
checkpoint (the Hybrid: FP8 W8A8 layers, then NVFP4 W4A4 layers) is another matter: its scales get the same tiny
random values, vLLM's post-load processing turns NVFP4's global scales into an output multiplier
(``alpha``: 2.6e7 on the tiny Hybrid, CPU test), and the packed 4-bit weights are whatever memory held
(zeros on the CPU, anything on a GPU). This format runs vLLM's dummy fill, then sets, before vLLM's
post-load processing (Marlin repacking on Hopper):

- every global scale (``weight_global_scale``, ``input_global_scale``) and static activation scale
  (``input_scale``) to 1,
- FP8 per-channel weight scales (``weight_scale`` in float32) to 1 (the FP8 weights keep vLLM's values),
- NVFP4 block scales (``weight_scale`` in float8) to 2^-9 (so no weight exceeds 6 x 2^-9 ~ 0.012),
- packed 4-bit weights (``weight_packed``) to seeded random bytes (every 4-bit code is finite).

For benchmarks of a quantized layout without its weights (a config-only 9B-shaped folder); for an
unquantized checkpoint, or one quantized online (``--quantization fp8``, whose scales come from the dummy
values), it is vLLM's ``dummy``.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

log = logging.getLogger("clef_vllm")

#: the load format's name (``--load-format clef-dummy``)
LOAD_FORMAT = "clef-dummy"
#: load formats that need no weight files
DUMMY_FORMATS = ("dummy", LOAD_FORMAT)
#: an NVFP4 block scale (float8 e4m3): the smallest subnormal, exactly representable
BLOCK_SCALE = 2.0 ** -9
_SEED = 1234
_registered = False


def is_dummy(load_format: str | None) -> bool:
    """Whether ``load_format`` makes up the weights (the checkpoint's configs are enough)."""
    return load_format in DUMMY_FORMATS


def dummy_format_for(config: dict) -> str:
    """The made-up-weights format for a checkpoint's ``config.json``: :data:`LOAD_FORMAT` when the checkpoint
    is quantized, else vLLM's ``dummy`` (what benchmarks without weights use)."""
    return LOAD_FORMAT if config.get("quantization_config") else "dummy"


@torch.no_grad()
def tame_quant_scales(model: torch.nn.Module) -> Counter:
    """Set a dummy-filled model's quantization parameters as the module docstring says; returns how many
    parameters of each kind were set."""
    done: Counter = Counter()
    generator = None
    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("weight_global_scale", "input_global_scale", "input_scale"):
            param.fill_(1.0)
        elif leaf == "weight_scale" and param.dtype == torch.float32:
            param.fill_(1.0)
        elif leaf == "weight_scale" and param.is_floating_point() and param.element_size() == 1:
            param.copy_(torch.full(param.shape, BLOCK_SCALE, dtype=torch.float32, device=param.device))
        elif leaf == "weight_packed" and param.dtype == torch.uint8:
            if generator is None:
                generator = torch.Generator(device=param.device)
                generator.manual_seed(_SEED)
            param.copy_(torch.randint(0, 256, param.shape, dtype=torch.uint8, device=param.device,
                                      generator=generator))
        else:
            continue
        done[leaf] += 1
    return done


def checkpoint_quantized(model_config) -> bool:
    """Whether the checkpoint itself is quantized (its config has a ``quantization_config``). Online
    quantization (``--quantization fp8``) computes its scales from the dummy values: they stay."""
    configs = (getattr(model_config, "hf_config", None), getattr(model_config, "hf_text_config", None))
    return any(getattr(c, "quantization_config", None) for c in configs if c is not None)


def register_loader() -> None:
    """Register :data:`LOAD_FORMAT` with vLLM's model loaders (idempotent; every process that builds a
    model calls it through the plugin's ``register``)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    @register_model_loader(LOAD_FORMAT)
    class ClefDummyLoader(DummyModelLoader):
        """vLLM's dummy weights, then :func:`tame_quant_scales`."""

        def load_weights(self, model, model_config) -> None:
            super().load_weights(model, model_config)
            if not checkpoint_quantized(model_config):
                return          # unquantized, or quantized online from the dummy values: vLLM's own scales
            done = tame_quant_scales(model)
            if done:
                log.info("clef-dummy: quantization parameters set to tame constants (%s)",
                         ", ".join(f"{k} {n}" for k, n in sorted(done.items())))

        def load_model(self, vllm_config, model_config, *args, **kwargs):
            """vLLM's load, then the kernels the model's linear layers run (a real checkpoint's load says
            them too, from the model's own ``load_weights``, which a dummy load never calls)."""
            model = super().load_model(vllm_config, model_config, *args, **kwargs)
            from clef_vllm.quant.kernels import kernel_report

            for line in kernel_report(model):
                log.info("clef kernels in use: %s", line)
            return model

    _registered = True
