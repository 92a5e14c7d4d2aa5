"""The vLLM backend's images: the engine's media settings, a request's prompt with its images, the largest image.

An engine takes images when the checkpoint can see (a vision tower and the release's image processor) and the
server does not run ``--text-only``; otherwise every media limit is 0 and vLLM builds no vision tower. A request
with images reaches vLLM as token ids with one ``<|image_pad|>`` per image and the decoded images; vLLM's processor
(the checkpoint's, as the release's) expands each pad to the image's tokens, and the backend checks that the ids
the engine ends up with are the encoder's.
"""

from __future__ import annotations

import dataclasses
import math

from clef_vllm.backends.options import VllmOptions
from clef_vllm.schema.encoding import EncodedRequest
from clef_vllm.schema.errors import Kind, RequestError

#: vLLM's per-prompt image limit when the engine takes images: above any ``--max-images`` (the server refuses more
#: first, naming the field); vLLM profiles the encoder with as many largest images as one step's encoder budget
#: holds, whatever this says.
ENGINE_MAX_IMAGES = 64
#: vLLM's cache of processed images in the front end (and its mirror in each engine core), GiB.
MM_PROCESSOR_CACHE_GB = 1


def sees(files, opts: VllmOptions) -> bool:
    """Whether the engine takes images: a checkpoint that can see, served without ``--text-only``."""
    return files.has_vision and not opts.text_only


def media_settings(files, opts: VllmOptions) -> dict:
    """The engine's media settings: images (no videos) through the vision tower, or none at all (its limits 0:
    vLLM then builds no tower and takes no multimodal path). Prompts arrive as token ids, so vLLM needs its
    tokenizer only for its image processor: skipped without images."""
    if not sees(files, opts):
        return {"limit_mm_per_prompt": {"image": 0, "video": 0}, "skip_tokenizer_init": True}
    image: dict = {"count": ENGINE_MAX_IMAGES}
    if opts.largest_image_pixels:          # vLLM profiles its encoder on a square of that many pixels
        image["width"] = image["height"] = math.isqrt(opts.largest_image_pixels)
    return {"limit_mm_per_prompt": {"image": image, "video": 0}, "skip_tokenizer_init": False,
            "mm_processor_cache_gb": MM_PROCESSOR_CACHE_GB}


def media_prompt(encoded: EncodedRequest, pad_id: int, largest: int | None = None) -> dict:
    """vLLM's prompt of a request with images: its ids with each image's run of pads collapsed to one pad (vLLM's
    processor expands each back to that image's token count, which the engine's ids are checked against) and
    the decoded images. Only the media block holds pad ids (typed media tokens stay text: schema/media.py).
    ``largest``: the most pixels an image may have (the engine's ``--max-image-pixels``): 413 naming the image."""
    for k, image in enumerate(encoded.media.images):
        if largest and image.width * image.height > largest:     # past what the engine's memory plan holds
            raise RequestError(f"{image.width}x{image.height} pixels; this server's engine takes images of at most "
                               f"{largest:,} pixels (--max-image-pixels)", kind=Kind.MEDIA_TOO_LARGE,
                               field=f"images[{k}]")
    out: list[int] = []
    runs: list[int] = []
    previous = None
    for t in encoded.input_ids:
        if t == pad_id:
            if previous == pad_id:
                runs[-1] += 1
                continue
            runs.append(1)
        out.append(t)
        previous = t
    if tuple(runs) != tuple(encoded.media.token_counts):
        raise RuntimeError(f"the prompt's image pads {runs} differ from its images' token counts "
                          f"{list(encoded.media.token_counts)}")
    return {"prompt_token_ids": out, "multi_modal_data": {"image": list(encoded.media.images)}}


def image_warmup(media, text: list[int], side: int = 256) -> tuple[dict, list[int]]:
    """vLLM's prompt of a warm-up request with one ``side`` x ``side`` image after ``text[:8]``, and the ids the
    engine makes of it (``media``: the encoder's ``MediaProcessor``)."""
    from PIL import Image

    count = media.image_tokens(side, side)
    prompt = {"prompt_token_ids": text[:8] + media.block([1]) + text[8:],
              "multi_modal_data": {"image": [Image.new("RGB", (side, side), (200, 30, 30))]}}
    return prompt, text[:8] + media.block([count]) + text[8:]


def engine_media_limits(limits, opts: VllmOptions):
    """The server's media limits (``MediaLimits``), no larger than the engine's largest image, so that a larger one
    is refused from its header, before any pixel is decoded."""
    largest = opts.largest_image_pixels
    if largest and largest < limits.max_pixels:
        return dataclasses.replace(limits, max_pixels=largest)
    return limits


__all__ = ["ENGINE_MAX_IMAGES", "MM_PROCESSOR_CACHE_GB", "engine_media_limits", "image_warmup", "media_prompt",
           "media_settings", "sees"]
