"""The vLLM backend's media: the engine's media settings, a request's prompt with its images and videos, the
largest item.

An engine takes images when the checkpoint can see (a vision tower and the release's image processor) and the
server does not run ``--text-only``; otherwise every media limit is 0 and vLLM builds no vision tower. It takes
videos too where the checkpoint has the release's video processor and torchvision is installed (transformers'
video processor needs it). A request with media reaches vLLM as token ids with the release's placeholder text
per item (one ``<|image_pad|>`` or ``<|video_pad|>`` between a start and an end) and the decoded images and videos
(a video: its frames and their metadata, every frame kept); vLLM's processor (the checkpoint's, as the release's)
expands each placeholder to the item's tokens, and the backend checks that the ids the engine ends up with are
the encoder's.

vLLM profiles its vision encoder on the largest image (its dummy video is two frames: one image's tokens); a video
is taken up to that image's tokens (413 beyond), so the memory plan's encoder line holds for both.
"""

from __future__ import annotations

import dataclasses
import math

from clef_vllm.backends.options import VllmOptions
from clef_vllm.schema.encoding import EncodedRequest
from clef_vllm.schema.errors import Kind, RequestError
from clef_vllm.schema.media_inputs import processor_backend

#: vLLM's per-prompt image limit when the engine takes images: above any ``--max-images`` (the server refuses more
#: first, naming the field); vLLM profiles the encoder with as many largest images as one step's encoder budget
#: holds, whatever this says.
ENGINE_MAX_IMAGES = 64
#: vLLM's per-prompt video limit when the engine takes videos (the server's ``--max-videos`` refuses more first).
ENGINE_MAX_VIDEOS = 8
#: vLLM's cache of processed images in the front end (and its mirror in each engine core), GiB.
MM_PROCESSOR_CACHE_GB = 1


def sees(files, opts: VllmOptions) -> bool:
    """Whether the engine takes images: a checkpoint that can see, served without ``--text-only``."""
    return files.has_vision and not opts.text_only


def takes_videos(files, opts: VllmOptions) -> bool:
    """Whether the engine takes videos: it sees, the checkpoint has the release's video processor, and
    transformers can run it here (torchvision installed)."""
    return sees(files, opts) and files.has_video and processor_backend() is None


def media_settings(files, opts: VllmOptions) -> dict:
    """The engine's media settings: images (and videos, :func:`takes_videos`) through the vision tower, or none at
    all (its limits 0: vLLM then builds no tower and takes no multimodal path). Prompts arrive as token ids, so
    vLLM needs its tokenizer only for its processor: skipped without media."""
    if not sees(files, opts):
        return {"limit_mm_per_prompt": {"image": 0, "video": 0}, "skip_tokenizer_init": True}
    image: dict = {"count": ENGINE_MAX_IMAGES}
    if opts.largest_image_pixels:          # vLLM profiles its encoder on a square of that many pixels
        image["width"] = image["height"] = math.isqrt(opts.largest_image_pixels)
    video: dict | int = 0
    if takes_videos(files, opts):          # its dummy: two frames of the image's size, one image's tokens
        video = {"count": ENGINE_MAX_VIDEOS, "num_frames": 2,
                 **{k: image[k] for k in ("width", "height") if k in image}}
    return {"limit_mm_per_prompt": {"image": image, "video": video}, "skip_tokenizer_init": False,
            "mm_processor_cache_gb": MM_PROCESSOR_CACHE_GB}


def media_prompt(encoded: EncodedRequest, largest: int | None = None, item_tokens: int | None = None) -> dict:
    """vLLM's prompt of a request with media: its ids with the media block as the placeholder text makes it (one
    pad per item: vLLM's processor expands each back to the item's tokens, which the engine's ids are checked
    against), the decoded images, and the videos' frames with their metadata. ``largest``: the most pixels an
    image may have (the engine's ``--max-image-pixels``); ``item_tokens``: the most tokens a video may make (the
    largest image's, what vLLM's encoder was profiled on): 413 naming the item past either."""
    media = encoded.media
    for k, image in enumerate(media.images):
        if largest and image.width * image.height > largest:     # past what the engine's memory plan holds
            raise RequestError(f"{image.width}x{image.height} pixels; this server's engine takes images of at most "
                               f"{largest:,} pixels (--max-image-pixels)", kind=Kind.MEDIA_TOO_LARGE,
                               field=f"images[{k}]")
    for k, tokens in enumerate(media.token_counts[media.num_images:]):
        if item_tokens and tokens > item_tokens:
            raise RequestError(f"makes {tokens:,} vision tokens; this server's engine takes a video of at most "
                               f"{item_tokens:,} (its largest image's, --max-image-pixels): send fewer or smaller "
                               "frames", kind=Kind.MEDIA_TOO_LARGE, field=f"videos[{k}]")
    a, b = encoded.media_offset, encoded.media_offset + encoded.media_tokens
    data: dict = {"image": list(media.images)} if media.images else {}
    if media.videos:
        data["video"] = list(media.videos)
    return {"prompt_token_ids": encoded.input_ids[:a] + list(media.prompt_block) + encoded.input_ids[b:],
            "multi_modal_data": data}


def video_tokens(media, opts: VllmOptions) -> int | None:
    """The most vision tokens a video may make on this engine: its largest image's, what vLLM's encoder is profiled
    on (``media``: the encoder's ``MediaProcessor``; None: no cap below the processor's own)."""
    largest = opts.largest_image_pixels
    if media is None or not largest:
        return None
    side = math.isqrt(largest)
    return media.image_tokens(side, side)


def image_warmup(media, text: list[int], side: int = 256) -> tuple[dict, list[int]]:
    """vLLM's prompt of a warm-up request with one ``side`` x ``side`` image after ``text[:8]``, and the ids the
    engine makes of it (``media``: the encoder's ``MediaProcessor``)."""
    from PIL import Image

    count = media.image_tokens(side, side)
    prompt = {"prompt_token_ids": text[:8] + media.prompt_block([1]) + text[8:],
              "multi_modal_data": {"image": [Image.new("RGB", (side, side), (200, 30, 30))]}}
    return prompt, text[:8] + media.block([count]) + text[8:]


def engine_media_limits(limits, opts: VllmOptions):
    """The server's media limits (``MediaLimits``), no larger than the engine's largest image (a larger one is
    refused from its header, before any pixel is decoded) and its per-prompt counts (the one past is 422)."""
    largest = opts.largest_image_pixels
    return dataclasses.replace(limits, max_pixels=min(limits.max_pixels, largest or limits.max_pixels),
                               max_images=min(limits.max_images, ENGINE_MAX_IMAGES),
                               max_videos=min(limits.max_videos, ENGINE_MAX_VIDEOS))


__all__ = ["ENGINE_MAX_IMAGES", "ENGINE_MAX_VIDEOS", "MM_PROCESSOR_CACHE_GB", "engine_media_limits", "image_warmup",
           "media_prompt", "media_settings", "sees", "takes_videos", "video_tokens"]
