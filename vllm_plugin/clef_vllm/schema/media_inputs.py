"""A request's images and videos as the backbone sees them: the checkpoint's processors, the media id block.

The release runs its processor on ``"<|vision_start|><|image_pad|><|vision_end|>"`` once per image, then
``"\\n"``, and inserts the result right after the prompt prefix (docs/encoding-and-head.md, "Media"). The
processor resizes each image to a multiple of 32 px (patch 16 x merge 2) between its ``min_pixels`` and
``max_pixels``, returns ``pixel_values`` (one row per 16 x 16 patch, two temporal copies) and
``image_grid_thw``, and expands each ``<|image_pad|>`` to ``t * h * w / merge**2`` copies: one token per
32 x 32 px. :class:`MediaProcessor` does exactly that with the checkpoint's own ``preprocessor_config.json``
(transformers' ``Qwen2VLImageProcessor``: its torchvision backend where torchvision is installed, else its
Pillow one, as transformers itself chooses), and keeps what a backend needs in :class:`MediaInputs`.

Videos go through the checkpoint's own ``Qwen3VLProcessor`` (transformers' video processor, which needs
torchvision): one call per video on ``"<|vision_start|><|video_pad|><|vision_end|>"`` gives its ids (one
``"<t seconds>"`` text and one ``<|vision_start|>`` pad run ``<|vision_end|>`` group per temporal patch of two
frames) and its ``pixel_values_videos`` / ``video_grid_thw``. A video's frames are taken at the processor's own
rate (``fps`` 2: frame ``i`` at ``i / 2`` seconds), so it keeps every frame. The media block is the images' blocks,
then the videos', then ``"\n"``: what the processor makes of the release's whole placeholder text, since special
tokens split the text it tokenizes. Videos are served only where torchvision is installed; elsewhere a video is
refused by name. A backend that runs the processor itself (vLLM: ``pixels`` off) gets each video's decoded frames
and their metadata (:attr:`MediaInputs.videos`) and, in :meth:`MediaProcessor.prompt_block`, the block as the
release's placeholder text makes it, before any pad is expanded.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from clef_vllm.schema.errors import Kind, RequestError
from clef_vllm.schema.media import MediaItem, no_check
from clef_vllm.util.lru import SizedLRU

log = logging.getLogger("clef_vllm")

#: The text the release's processor expands, per image, per video, and after the last item.
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
MEDIA_END = "\n"
#: The rate a video's frames are taken at: the release's video processor's ``fps`` (every frame kept).
VIDEO_FPS = 2.0
#: the bound on the video ids kept by size (:class:`MediaProcessor`, without pixels): bytes (40 a token, a Python
#: int in a tuple), entries
VIDEO_IDS_BYTES, VIDEO_IDS_ITEMS = 16 << 20, 512


@dataclass(frozen=True, eq=False)
class VideoBlock:
    """One video as the checkpoint's processor makes it: its ids (timestamps, starts, pads, ends), its pad
    tokens, and its tensors."""

    ids: tuple[int, ...]
    pads: int
    pixel_values: Any                    # None where the backend runs the processor itself (vLLM) ...
    grid_thw: Any
    frames: Any = None                   # ... which gets the decoded frames instead: uint8 [frames, height, width, 3]

    def metadata(self) -> dict:
        """The frames' metadata as vLLM's Qwen3-VL processor takes it: every frame kept, frame ``i`` at ``i / 2``
        seconds (what the reference's processor call samples, see :func:`video_metadata`)."""
        n, height, width = self.frames.shape[:3]
        return dict(video_metadata(n, width, height), do_sample_frames=False)


@dataclass(frozen=True, eq=False)
class MediaInputs:
    """The images of one request, processed. ``images``: RGB ``PIL.Image`` objects in request order (what a
    backend with its own processor, such as vLLM, takes); ``pixel_values`` / ``image_grid_thw``: the
    processor's tensors (what a transformers backbone takes); ``token_counts``: the pad tokens of each image;
    ``digest``: a hash of every image's content and the processor's settings, in order (two requests with the
    same token ids but other pictures never share a digest)."""

    images: tuple
    pixel_values: Any                    # None where the backend processes the images itself (vLLM)
    image_grid_thw: Any
    token_counts: tuple[int, ...]        # images' pads, then each video's
    digest: bytes
    pixel_values_videos: Any = None      # the videos' tensors (the reference backend only)
    video_grid_thw: Any = None
    videos: tuple = ()                   # per video (its frames, their metadata): a backend with its own processor
    prompt_block: tuple[int, ...] = ()   # the block before the processor expands it (MediaProcessor.prompt_block)

    @property
    def num_images(self) -> int:
        return len(self.images)

    @property
    def num_tokens(self) -> int:
        """Pad tokens of all images (the media block adds a start and an end token per image, and a newline)."""
        return sum(self.token_counts)


class MediaProcessor:
    """The checkpoint's image processor and the media tokens' ids. Thread-safe (its one store, video ids by size, is
    locked)."""

    def __init__(self, image_processor, token_ids: dict[str, int], newline_ids: Sequence[int], pixels: bool = True,
                 video_processor=None, no_videos: str = "this checkpoint has no video processor"):
        self.image_processor = image_processor
        #: the checkpoint's whole ``Qwen3VLProcessor`` (videos), or None; then ``no_videos`` says why
        self.video_processor = video_processor
        #: without :attr:`pixels`, a video's ids and grid by its frame count, height and width: they depend on nothing
        #: else, so a video of a size seen lately is not run through the processor again
        self._video_ids = SizedLRU(VIDEO_IDS_BYTES, max_items=VIDEO_IDS_ITEMS)
        self.no_videos = no_videos
        #: whether :meth:`inputs` runs the processor (False: a backend that runs it itself gets decoded images)
        self.pixels = pixels
        self.merge_size = int(getattr(image_processor, "merge_size", 2))
        self.start_id = token_ids["<|vision_start|>"]
        self.end_id = token_ids["<|vision_end|>"]
        self.pad_id = token_ids["<|image_pad|>"]
        self.video_pad_id = token_ids.get("<|video_pad|>")
        self.newline_ids = list(newline_ids)
        settings = {k: v for k, v in sorted(image_processor.to_dict().items()) if not k.startswith("_")}
        if video_processor is not None:
            settings["video"] = {k: v for k, v in sorted(video_processor.video_processor.to_dict().items())
                                 if not k.startswith("_")}
        self._settings = repr(settings).encode()

    @classmethod
    def from_pretrained(cls, folder: str | Path, tokenizer, pixels: bool = True) -> "MediaProcessor | None":
        """The processor of a checkpoint folder, or ``None`` when it has no ``preprocessor_config.json`` (a
        text-only checkpoint). ``tokenizer``: a ``tokenizers.Tokenizer`` holding the media tokens; ``pixels``:
        see :attr:`pixels`."""
        folder = Path(folder)
        if not (folder / "preprocessor_config.json").is_file():
            return None
        from transformers import AutoImageProcessor
        from transformers.utils import logging as tf_logging

        quiet = tf_logging.get_verbosity()
        tf_logging.set_verbosity_error()       # "torchvision is not installed, falling back to Pillow": by design
        try:
            processor = AutoImageProcessor.from_pretrained(str(folder), backend=processor_backend())
        finally:
            tf_logging.set_verbosity(quiet)
        ids = {}
        for token in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"):
            tid = tokenizer.token_to_id(token)
            if tid is None:
                raise ValueError(f"{folder}: the tokenizer has no {token} token; the image processor needs it")
            ids[token] = tid
        newline = [e.ids for e in tokenizer.encode_batch([MEDIA_END], add_special_tokens=False)][0]
        ids["<|video_pad|>"] = tokenizer.token_to_id("<|video_pad|>")
        videos, why = _video_processor(folder)
        return cls(processor, ids, newline, pixels=pixels, video_processor=videos, no_videos=why)

    def describe(self) -> dict:
        p = self.image_processor
        return {"image_processor": type(p).__name__, "merge_size": self.merge_size,
                "patch_size": getattr(p, "patch_size", None), "min_pixels": _pixels(p, "shortest_edge", "min_pixels"),
                "max_pixels": _pixels(p, "longest_edge", "max_pixels")}

    def token_counts(self, items: Sequence[MediaItem],
                     checkpoint: Callable[[], None] | None = None) -> tuple[int | VideoBlock, ...]:
        """Per image its pad tokens (:meth:`image_tokens`), from the sizes its header declares (no pixel is
        decoded). Per video (images come
        first on the wire) its :class:`VideoBlock`: the processor runs on its frames here, since its ids depend on
        them."""
        videos = [m for m in items if m.kind == "video"]
        if videos and self.video_processor is None:
            raise RequestError(f"videos are not served here: {self.no_videos}", kind=Kind.UNSUPPORTED,
                               field=videos[0].field.split("[", 1)[0])
        return tuple(self._image_tokens(m) if m.kind == "image" else self.video_block(m, checkpoint) for m in items)

    def _image_tokens(self, item: MediaItem) -> int:
        try:
            return self.image_tokens(item.height, item.width)
        except ValueError as exc:     # the processor's own limit: an aspect ratio below 200
            raise _refused("image", item, exc) from None

    def image_tokens(self, height: int, width: int) -> int:
        """The pad tokens of an image of ``height`` x ``width`` px: the processor's resize to a multiple of 32 px
        within its pixel bounds, one token per 32 x 32 px."""
        return self.image_processor.get_number_of_image_patches(height, width, {}) // self.merge_size ** 2

    def video_block(self, item: MediaItem, checkpoint: Callable[[], None] | None = None) -> VideoBlock:
        """One video through the checkpoint's processor (its frames at :data:`VIDEO_FPS`). Without :attr:`pixels`
        the processor runs for the ids alone (they depend on the frames' grid); the block keeps the frames."""
        import numpy as np
        from transformers.video_utils import VideoMetadata

        n = item.frames
        frames = np.empty((n, item.height, item.width, 3), np.uint8)     # filled one decoded frame at a time
        for i, frame in enumerate(item.rgb_frames(checkpoint)):
            frames[i] = np.asarray(frame)
        shape = (n, item.height, item.width)
        if not self.pixels and (known := self._video_ids.get(shape)) is not None:
            return VideoBlock(*known, frames=frames)
        metadata = VideoMetadata(**video_metadata(n, item.width, item.height))
        try:
            out = self.video_processor(text=[VIDEO_PLACEHOLDER], videos=[frames], video_metadata=[metadata],
                                       return_tensors="pt", **video_kwargs(self.video_processor))
        except ValueError as exc:     # the processor's own limits (two frames at least, aspect ratio below 200)
            raise _refused("video", item, exc) from None
        ids = tuple(int(i) for i in out["input_ids"][0])
        if ids[0] != self.start_id:       # transformers 5.25 on drops the placeholder's own start and end (nested)
            ids = (self.start_id, *ids, self.end_id)
        pads = sum(1 for i in ids if i == self.video_pad_id)
        if self.pixels:
            return VideoBlock(ids, pads, out["pixel_values_videos"], out["video_grid_thw"])
        self._video_ids.put(shape, (ids, pads, None, out["video_grid_thw"]), 64 + 40 * len(ids))
        return VideoBlock(ids, pads, None, out["video_grid_thw"], frames=frames)

    def prompt_block(self, counts: Sequence[int | VideoBlock]) -> list[int]:
        """The media block before the processor expands it, as the release's placeholder text tokenizes: per image
        its start, one ``<|image_pad|>`` and its end; per video its start, one ``<|video_pad|>`` and its end; then
        a newline (what a backend that runs the processor itself, vLLM, is given)."""
        ids: list[int] = []
        for n in counts:
            ids += [self.start_id, self.video_pad_id if isinstance(n, VideoBlock) else self.pad_id, self.end_id]
        return ids + self.newline_ids

    def block(self, counts: Sequence[int | VideoBlock]) -> list[int]:
        """The media id block: per image its start token, ``counts[i]`` pads and its end token; per video its
        :class:`VideoBlock`'s ids; then a newline."""
        ids: list[int] = []
        for n in counts:
            if isinstance(n, VideoBlock):
                ids.extend(n.ids)
                continue
            ids.append(self.start_id)
            ids.extend([self.pad_id] * n)
            ids.append(self.end_id)
        return ids + self.newline_ids

    def inputs(self, items: Sequence[MediaItem], counts: Sequence[int | VideoBlock],
               checkpoint: Callable[[], None] | None = None) -> MediaInputs:
        """The images decoded and processed, the videos' tensors (what a backend needs); ``counts``:
        :meth:`token_counts`."""
        check = checkpoint or no_check
        videos = [n for n in counts if isinstance(n, VideoBlock)]
        counts = [n for n in counts if not isinstance(n, VideoBlock)]
        images = []
        for item in items:
            if item.kind != "image":
                continue
            check()
            images.append(item.frames_rgb()[0])
        check()
        if not images:
            pixel_values = grid = None
            got = ()
        elif self.pixels:
            out = self.image_processor(images=images, return_tensors="pt")
            pixel_values, grid = out["pixel_values"], out["image_grid_thw"]
            got = tuple(int(g.prod()) // self.merge_size ** 2 for g in grid)
        else:
            pixel_values = grid = None
            got = tuple(self.image_tokens(im.height, im.width) for im in images)
        if got != tuple(counts):                  # a header that lied about the size; parse_media decodes it
            raise RequestError(f"the decoded images make {got} tokens, their headers {tuple(counts)}",
                               kind=Kind.MEDIA_INVALID, field="images")
        digest = hashlib.blake2b(self._settings, digest_size=16)
        for item in items:
            digest.update(item.digest.encode())
        prompt = () if self.pixels else tuple(self.prompt_block([*got, *videos]))
        if not videos:
            return MediaInputs(tuple(images), pixel_values, grid, got, digest.digest(), prompt_block=prompt)
        counts = got + tuple(v.pads for v in videos)
        if not self.pixels:
            return MediaInputs(tuple(images), None, None, counts, digest.digest(), prompt_block=prompt,
                               videos=tuple((v.frames, v.metadata()) for v in videos))
        import torch

        return MediaInputs(tuple(images), pixel_values, grid, counts, digest.digest(),
                           torch.cat([v.pixel_values for v in videos]), torch.cat([v.grid_thw for v in videos]))


def _refused(processor: str, item: MediaItem, exc: ValueError) -> RequestError:
    """422 naming an item the checkpoint's ``processor`` (image or video) refuses, with its reason."""
    return RequestError(f"the checkpoint's {processor} processor refuses it: {exc}", kind=Kind.MEDIA_INVALID,
                        field=item.field)


def video_kwargs(processor) -> dict:
    """What every call of the checkpoint's ``processor`` (transformers' ``Qwen3VLProcessor``) with a video is given
    beside the frames, here and in vLLM's front end: no per-frame pixel cap (``cap_pixels_per_frame``), as the
    release's processor (transformers 5.10.2) resizes. Newer transformers warn that such a cap will become their
    default; where the setting does not exist there is no cap and nothing is passed."""
    capped = hasattr(getattr(processor, "video_processor", None), "cap_pixels_per_frame")
    return {"cap_pixels_per_frame": False} if capped else {}


def video_metadata(frames: int, width: int, height: int) -> dict:
    """A video's metadata as the processor is given it: ``frames`` frames at :data:`VIDEO_FPS`, every one kept."""
    return dict(total_num_frames=frames, fps=VIDEO_FPS, width=width, height=height, duration=frames / VIDEO_FPS,
                frames_indices=list(range(frames)))


def _video_processor(folder: Path):
    """``(the checkpoint's Qwen3VLProcessor, "")`` for its videos, or ``(None, why not)``."""
    if not (folder / "video_preprocessor_config.json").is_file():
        return None, "this checkpoint has no video processor"
    if processor_backend() is not None:
        return None, ("the release's video processor needs torchvision, which is not installed here (vLLM 0.28 "
                      "pins torchvision==0.28.0)")
    from transformers import AutoProcessor
    from transformers.utils import logging as tf_logging

    quiet = tf_logging.get_verbosity()
    tf_logging.set_verbosity_error()
    try:
        return AutoProcessor.from_pretrained(str(folder)), ""
    finally:
        tf_logging.set_verbosity(quiet)


def processor_backend() -> str | None:
    """``"pil"`` unless a real torchvision imports (then transformers' default, its torchvision backend): an
    import-only stand-in, as vLLM's CPU test harness installs, has no ``__file__``."""
    try:
        import torchvision
    except Exception:  # noqa: BLE001 - a broken torchvision (CUDA build beside CPU torch) raises several types
        return "pil"
    return None if getattr(torchvision, "__file__", None) else "pil"


def _pixels(processor, size_key: str, attr: str) -> int | None:
    size = getattr(processor, "size", None) or {}
    value = size.get(size_key) if isinstance(size, dict) else None
    return value if value is not None else getattr(processor, attr, None)


__all__ = ["IMAGE_PLACEHOLDER", "MEDIA_END", "VIDEO_FPS", "VIDEO_PLACEHOLDER", "MediaInputs", "MediaProcessor",
           "VideoBlock", "processor_backend", "video_kwargs", "video_metadata"]
