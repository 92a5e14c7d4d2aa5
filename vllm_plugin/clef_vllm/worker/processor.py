"""The multimodal processor vLLM runs for ``ClefFlashForDecision``: vLLM 0.28's Qwen3-VL processor (the checkpoint's
own processors expand each image's and each video's placeholder), made to work with every transformers it allows.

vLLM's Qwen3-VL processor expands each video itself (one call of the checkpoint's processor per video), then calls
the checkpoint's processor once more for the rest of the prompt, with the videos taken out of its data but their
``<|video_pad|>`` placeholders still in its text (their ids are swapped for each video's expansion afterwards).
transformers 5.23 and later refuse that call: "Found 1 <|video_pad|> tokens in the text but no videos were
passed", so every request with a video failed in vLLM's front end. :class:`ClefMultiModalProcessor` hands that
call each such placeholder as ``<|vision_pad|>`` (a special token no processor expands) and puts the
``<|video_pad|>`` id back in the ids it returns, so vLLM's swap finds its placeholders; each video's own call gets
what the encoder gives the video processor (:func:`~clef_vllm.schema.media_inputs.video_kwargs`); every other call
is vLLM's own.

The release's ids nest each video's timestamped frame groups inside its placeholder's own ``<|vision_start|>`` and
``<|vision_end|>`` (it was saved with transformers 5.10.2). vLLM keeps that nesting only with a transformers of 5.10
or later (it swaps the bare ``<|video_pad|>``); with an older one, which vLLM 0.28 also allows, it swaps the whole
placeholder and the pair is lost. :class:`ClefMultiModalProcessor` always swaps the bare pad, so vLLM's ids are the
release's (and the encoder's, which the backend checks per request) whatever transformers is installed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import BatchFeature
from vllm.model_executor.models.qwen3_vl import Qwen3VLMultiModalProcessor
from vllm.multimodal.processing import BaseMultiModalProcessor

from clef_vllm.schema.media_inputs import video_kwargs

VIDEO_PAD = "<|video_pad|>"
#: What a video's placeholder is called in the call that has no videos (a special token of Qwen3.5's vocabulary
#: that neither the image nor the video processor expands).
STAND_IN = "<|vision_pad|>"


class _VideoCalls(BaseMultiModalProcessor):
    """The checkpoint processor's calls for a prompt with videos: each video's own, and the one for the rest of the
    prompt without them. Sits between vLLM's Qwen3-VL processor and its base class (see the module's docstring)."""

    def _call_hf_processor(self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object],
                           tok_kwargs: Mapping[str, object]) -> BatchFeature:
        if mm_data.get("videos"):          # one video's own call: as the encoder calls the video processor
            extra = video_kwargs(self.info.get_hf_processor())
            return super()._call_hf_processor(prompt, mm_data, {**mm_kwargs, **extra}, tok_kwargs)
        if not isinstance(prompt, str) or VIDEO_PAD not in prompt or STAND_IN in prompt:
            return super()._call_hf_processor(prompt, mm_data, mm_kwargs, tok_kwargs)
        out = super()._call_hf_processor(prompt.replace(VIDEO_PAD, STAND_IN), mm_data, mm_kwargs, tok_kwargs)
        tokenizer = self.info.get_tokenizer()
        stand_in, pad = tokenizer.convert_tokens_to_ids(STAND_IN), tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        ids = out["input_ids"]
        if isinstance(ids, torch.Tensor):
            out["input_ids"] = torch.where(ids == stand_in, pad, ids)
        else:
            out["input_ids"] = [[pad if t == stand_in else t for t in row] for row in ids]
        return out


class ClefMultiModalProcessor(Qwen3VLMultiModalProcessor, _VideoCalls):
    """vLLM's Qwen3-VL processor; its calls of the checkpoint's processor for a prompt with videos go through
    :class:`_VideoCalls`, and it expands each video's bare pad, keeping the placeholder's start and end around the
    frames (the module's docstring)."""

    @staticmethod
    def _expands_only_video_token(hf_processor: object) -> bool:
        return True


__all__ = ["ClefMultiModalProcessor"]
