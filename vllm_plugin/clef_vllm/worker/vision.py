"""The vision half of ``ClefFlashForDecision``: vLLM's Qwen3.5 vision tower in BF16, its image features merged
into the step's embeddings, and the M-RoPE positions of a prompt with images.

The tower is vLLM's ``Qwen3_VisionTransformer`` built from the checkpoint's ``vision_config`` exactly as vLLM's
``Qwen3_5ForConditionalGeneration`` builds it, except that it is never quantized (both layouts keep it BF16: a
compressed-tensors checkpoint lists its modules under ``ignore``). It is built only when the engine takes images:
an engine whose media limits are all 0 (``--text-only``, or a checkpoint without an image processor) allocates
nothing for it and skips its tensors. vLLM runs the processor (each ``<|image_pad|>`` of the prompt expanded to
the image's ``t * h * w / merge**2`` tokens), the encoder cache and the scheduling of encoder work; this module
gives the model class the three hooks vLLM calls.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

#: Checkpoint -> vLLM names of the tower's tensors (the release keeps them under ``model.visual.``).
NAME_MAP = (("model.visual.", "visual."),)
#: What vLLM's processor looks for in a prompt, per item (the release's media text).
PLACEHOLDERS = {"image": "<|vision_start|><|image_pad|><|vision_end|>",
                "video": "<|vision_start|><|video_pad|><|vision_end|>"}


def placeholder(modality: str) -> str:
    for kind, text in PLACEHOLDERS.items():
        if modality.startswith(kind):
            return text
    raise ValueError(f"only images and videos have placeholders, not {modality!r}")


def takes_media(vllm_config) -> bool:
    """Whether this engine takes images or videos: a vision config and a media limit above 0."""
    model_config = vllm_config.model_config
    mm = model_config.multimodal_config
    if mm is None or getattr(model_config.hf_config, "vision_config", None) is None:
        return False
    return any(mm.get_limit_per_prompt(m) for m in PLACEHOLDERS)


def build_tower(vllm_config) -> torch.nn.Module | None:
    """The vision tower (unquantized, in the model's dtype), or ``None`` when the engine takes no media."""
    if not takes_media(vllm_config):
        return None
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer

    config = vllm_config.model_config.hf_config
    return Qwen3_VisionTransformer(config.vision_config, norm_eps=getattr(config, "rms_norm_eps", 1e-6),
                                   quant_config=None, prefix="visual")


def embed_images(tower: torch.nn.Module | None, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """One ``[tokens, hidden]`` tensor per image (then per video), in prompt order: the tower's merged patches
    of vLLM's batched ``pixel_values`` / ``image_grid_thw`` (``pixel_values_videos`` / ``video_grid_thw``)."""
    out: list[torch.Tensor] = []
    for pixels_key, grid_key in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        pixels = kwargs.get(pixels_key)
        if pixels is None:
            continue
        if tower is None:
            raise RuntimeError("media reached an engine without a vision tower (its media limits are 0)")
        grid = kwargs[grid_key]
        if isinstance(grid, (list, tuple)):
            grid = torch.stack([torch.as_tensor(g) for g in grid])
        if isinstance(pixels, (list, tuple)):
            pixels = torch.cat(list(pixels))
        features = tower(pixels.type(tower.dtype), grid_thw=grid)
        merge = tower.spatial_merge_size
        out.extend(features.split((grid.prod(-1) // merge // merge).tolist()))
    return out


def merge(embeds: torch.Tensor, features: Sequence[torch.Tensor], is_multimodal: torch.Tensor | None) -> torch.Tensor:
    """The step's embeddings with each image token's row replaced by its feature (vLLM's scatter)."""
    from vllm.model_executor.models.utils import _merge_multimodal_embeddings

    if is_multimodal is None:
        raise ValueError("image features without vLLM's is_multimodal mask")
    return _merge_multimodal_embeddings(inputs_embeds=embeds, multimodal_embeddings=features,
                                        is_multimodal=is_multimodal)


def mrope_positions(config, input_tokens: list[int], mm_features: list[object]) -> tuple[torch.Tensor, int]:
    """``[3, len]`` positions and the position delta: ``arange`` in every section for a text prompt; with
    images, vLLM's Qwen3-VL rule (text continues from the largest position so far, an image's tokens take
    its grid's (t, h, w) indices)."""
    if not mm_features:
        positions = torch.arange(len(input_tokens), dtype=torch.long)
        return positions.unsqueeze(0).expand(3, -1), 0
    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration._get_mrope_input_positions(input_tokens, mm_features, config)


__all__ = ["NAME_MAP", "PLACEHOLDERS", "build_tower", "embed_images", "merge", "mrope_positions", "placeholder",
           "takes_media"]
