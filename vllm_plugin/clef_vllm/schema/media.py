"""Media on the wire: ``images`` (and ``videos``, reference dialect), validated before any model sees them.

Two steps, so that no pixel is ever decoded on the server's event loop:

* :func:`parse_media` (part of parsing): each entry's bytes (a ``data:`` URI with base64; bare base64 in the
  ``workers-ai`` dialect; offline also bytes, a local path or a ``PIL.Image``), its size in bytes, its format
  (Pillow, restricted to the accepted formats, against the declared MIME type) and its declared pixel size and
  frame count, read from the header only: a 100,000 x 100,000 PNG of a few KB is refused here, never allocated.
* :func:`decode_media` (the server runs it in its CPU pool): every frame decoded once, so truncated or corrupt
  data is refused by name; the pixels are then dropped (a backend decodes again, :meth:`MediaItem.frames`).

Remote URLs and server-local paths are never read (a public server must not fetch what a client names).
Every refusal is a :class:`~clef_vllm.schema.errors.RequestError` naming the entry (``images[2]``,
``videos[0][3]`` for a frame): :attr:`Kind.MEDIA_MALFORMED` (400; hosted code 5006) for what is not an inline
image at all, :attr:`Kind.MEDIA_INVALID` (422; 5012) for bytes that are no accepted image and for too many
entries, :attr:`Kind.MEDIA_TOO_LARGE` (413; 5021) for bytes, pixels and frames over the limits.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from clef_vllm.schema.errors import ClefError, Kind, RequestError

MIB = 1 << 20
#: Pillow's format name of each accepted MIME type (``image/jpg`` is a common misspelling of ``image/jpeg``).
MIME_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
                "image/gif": "GIF"}
FORMAT_NAMES = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP", "GIF": "GIF"}
#: The request keys holding media, and the kind of each entry.
MEDIA_KEYS = {"images": "image", "videos": "video"}
#: Pixels of the release processor's ``max_pixels`` (an image is resized below it, never refused by it).
PROCESSOR_MAX_PIXELS = 16_777_216


@dataclass(frozen=True)
class MediaLimits:
    """What one request may carry. Bytes are the decoded file bytes (base64 takes 4/3 as many on the wire);
    pixels are width x height of one image or one video frame."""

    max_images: int = 8
    max_videos: int = 1
    max_video_frames: int = 768               # the processor's max_frames
    max_item_bytes: int = 16 * MIB            # one image, or one video (all its frames)
    max_total_bytes: int = 32 * MIB           # every image and video of the request
    max_pixels: int = PROCESSOR_MAX_PIXELS    # one image or one video frame
    max_total_pixels: int = 8 * PROCESSOR_MAX_PIXELS   # every image and frame: bounds the decoding work
    formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF")
    bare_base64: bool = False                 # an entry may be base64 without the data: URI around it
    videos: bool = True                       # False: the dialect has no ``videos`` field (422 "unknown field")


#: Host memory one pixel of a request's images and frames is budgeted at while the request is in progress
#: (``--max-media-memory``): the processor's float32 copies of it (resized, normalised, cut into patches) and its
#: decoded RGB bytes. Measured peak over pixels, encoding one request: 61-67 bytes with the processor's tensors,
#: 4 for the decoded frames the vLLM front end keeps (vLLM's own processor then runs as the reference's does);
#: ``bench/media_speed.py --host-memory``. Counted above the largest measured peak.
HOST_BYTES_PER_PIXEL = 72
#: Host memory the media of the requests in progress may take together (the server's ``--max-media-memory``, the
#: offline API's ``max_media_memory``): 2 GiB is one 16 MP picture (1.2 GB) and smaller ones beside it, or about
#: 110 of 512 x 512, at once.
DEFAULT_MAX_MEDIA_MEMORY = 2 << 30


def host_bytes(items: Sequence["MediaItem"]) -> int:
    """What a request's media are budgeted at in host memory: their pixels (every image, every frame of every
    video, as their headers declare them) times :data:`HOST_BYTES_PER_PIXEL`."""
    return HOST_BYTES_PER_PIXEL * sum(item.width * item.height * item.frames for item in items)


#: The reference dialect's defaults (each a server flag: --max-images ...).
DEFAULT_MEDIA_LIMITS = MediaLimits()
#: The hosted service's body cap (its documented 13 MiB): the workers-ai dialect's, below ``--max-body-bytes``.
HOSTED_MAX_BODY_BYTES = 13 * MIB
#: The hosted Workers AI service, exactly: PNG/JPEG/WebP, <= 4 images of <= 16 MP (16.00 MP is accepted,
#: 16.38 MP refused) and <= 4 MiB each, 8 MiB in all, bare base64 accepted, no videos.
WORKERS_AI_MEDIA_LIMITS = MediaLimits(max_images=4, max_videos=0, max_item_bytes=4 * MIB, max_total_bytes=8 * MIB,
                                      max_pixels=16_000_000, max_total_pixels=4 * 16_000_000,
                                      formats=("PNG", "JPEG", "WEBP"), bare_base64=True, videos=False)


@dataclass(frozen=True)
class MediaItem:
    """One validated image or video. ``sources``: the file bytes (one, or one per frame of a video given as
    frames), or ``PIL.Image`` objects given to the offline API. ``digest`` hashes the content (what the
    backends' caches will key on)."""

    kind: str                  # "image" | "video"
    field: str                 # "images[2]"
    format: str                # Pillow's name: PNG, JPEG, WEBP, GIF; "Image" for a PIL.Image given offline
    width: int
    height: int
    frames: int                # 1 for an image
    sources: tuple
    digest: str

    @property
    def nbytes(self) -> int:
        return sum(len(s) for s in self.sources if isinstance(s, (bytes, bytearray)))

    def rgb_frames(self, check: Callable[[], None] | None = None):
        """Each decoded frame as an RGB ``PIL.Image``, one at a time (an image: its first frame only); ``check`` is
        called between frames (it raises to stop the work)."""
        for frame in _frames(self, check=check or no_check):
            yield frame.convert("RGB")

    def frames_rgb(self) -> list:
        """The decoded frames as RGB ``PIL.Image`` objects (an image: its first frame only)."""
        return list(self.rgb_frames())


# --------------------------------------------------------------------------- errors


def _malformed(message: str, field: str) -> RequestError:
    return RequestError(message, kind=Kind.MEDIA_MALFORMED, field=field)


def _invalid(message: str, field: str) -> RequestError:
    return RequestError(message, kind=Kind.MEDIA_INVALID, field=field)


def _too_large(message: str, field: str) -> RequestError:
    return RequestError(message, kind=Kind.MEDIA_TOO_LARGE, field=field)


def _mib(n: int) -> str:
    return f"{n / MIB:.2f} MiB" if n % MIB else f"{n // MIB} MiB"


def _accepted(limits: MediaLimits) -> str:
    return ", ".join(FORMAT_NAMES[f] for f in limits.formats)


# --------------------------------------------------------------------------- entry -> bytes

_DATA_URI = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.ASCII)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_B64_WHITESPACE = re.compile(rb"[ \t\r\n]+")


def _b64(text: str, field: str, limits: MediaLimits, what: str) -> bytes:
    """Strict base64 (standard alphabet, padded; line breaks and spaces are ignored), size checked first."""
    raw = text.encode("ascii", "replace")
    if _B64_WHITESPACE.search(raw):
        raw = _B64_WHITESPACE.sub(b"", raw)
    if len(raw) // 4 * 3 > limits.max_item_bytes + 2:
        raise _too_large(f"{what} holds about {_mib(len(raw) // 4 * 3)}; at most {_mib(limits.max_item_bytes)} "
                         "per item are allowed", field)
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _malformed(f"{what} is not valid base64 ({exc})", field) from None


def _entry_bytes(entry: Any, field: str, limits: MediaLimits, local: bool) -> tuple[Any, str | None]:
    """``(bytes or PIL.Image, the declared Pillow format or None)`` of one entry."""
    if isinstance(entry, str):
        head = entry[:256].lstrip()
        if head[:5].lower() == "data:":
            match = _DATA_URI.match(head)
            if match is None:
                raise _malformed("is not a valid data: URI (expected data:image/png;base64,...)", field)
            mime = match.group(1).strip().lower()
            params = [p.strip().lower() for p in match.group(2).split(";") if p.strip()]
            if "base64" not in params:
                raise _malformed("data: URIs must be base64-encoded (data:image/png;base64,...)", field)
            fmt = MIME_FORMATS.get(mime)
            if fmt is None or fmt not in limits.formats:
                shown = mime or "no MIME type"
                raise _invalid(f"{shown} is not accepted; images must be {_accepted(limits)}", field)
            start = len(entry) - len(entry.lstrip()) + match.end()
            return _b64(entry[start:], field, limits, "the data: URI"), fmt
        if _SCHEME.match(head) or head.lower().startswith("www."):
            raise _malformed("remote URLs are not fetched: send the image inline as a data: URI "
                             "(data:image/png;base64,...)", field)
        if local:
            return _read_path(Path(entry), field, limits), None
        if limits.bare_base64:
            return _b64(entry, field, limits, "the entry (neither a data: URI nor base64)"), None
        raise _malformed("must be a data: URI (data:image/png;base64,...); server-local paths are not read", field)
    if local:
        if isinstance(entry, (bytes, bytearray, memoryview)):
            data = bytes(entry)
            if len(data) > limits.max_item_bytes:
                raise _too_large(f"has {_mib(len(data))}; at most {_mib(limits.max_item_bytes)} per item are allowed",
                                 field)
            return data, None
        if isinstance(entry, Path):
            return _read_path(entry, field, limits), None
        if _is_pil_image(entry):
            return entry, None
        raise _malformed(f"must be a data: URI, bytes, a path or a PIL.Image, got a {type(entry).__name__}", field)
    raise _malformed(f"must be a string (a data: URI), got {_json_type(entry)}", field)


def _read_path(path: Path, field: str, limits: MediaLimits) -> bytes:
    """A local file (offline API only), its size checked before it is read."""
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise _malformed(f"{str(path)[:200]} is not a file", field)
        if size > limits.max_item_bytes:
            raise _too_large(f"{str(path)[:200]} has {_mib(size)}; at most {_mib(limits.max_item_bytes)} per item are "
                             "allowed", field)
        return path.read_bytes()
    except OSError as exc:
        raise _malformed(f"cannot read {str(path)[:200]}: {exc.strerror or exc}", field) from None


def _is_pil_image(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:
        return False
    return isinstance(value, Image.Image)


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), f"a {type(value).__name__}")


# --------------------------------------------------------------------------- header checks


@dataclass
class _Totals:
    bytes: int = 0
    pixels: int = 0


def _open(data: bytes, field: str, limits: MediaLimits, declared: str | None):
    """The image opened from its header (no pixel decoded), its format checked against ``declared``."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data), formats=list(limits.formats))
    except Image.DecompressionBombError as exc:          # Pillow's own check, far above ours: the header's size
        found = re.search(r"\((\d+) pixels\)", str(exc))
        declared_px = f"{int(found.group(1)):,} pixels" if found else "more pixels than any image may have"
        raise _too_large(f"declares {declared_px} in its header; at most {limits.max_pixels:,} are allowed", field) from None
    except UnidentifiedImageError:
        raise _invalid(f"is not a {_accepted(limits)} image (or its header is corrupt)", field) from None
    except Exception as exc:  # noqa: BLE001 - Pillow's plugins raise many types on hostile headers
        raise _invalid(f"has a corrupt header ({type(exc).__name__}: {str(exc)[:120]})", field) from None
    if declared is not None and image.format != declared:
        image.close()
        raise _invalid(f"declares {FORMAT_NAMES[declared]} (its MIME type) but the data is "
                       f"{FORMAT_NAMES.get(image.format, image.format)}", field)
    return image


def _check_pixels(width: int, height: int, frames: int, field: str, limits: MediaLimits, totals: _Totals) -> None:
    pixels = width * height
    if width < 1 or height < 1:
        raise _invalid(f"has no pixels ({width}x{height})", field)
    if pixels > limits.max_pixels:
        raise _too_large(f"is {width}x{height} = {pixels:,} pixels ({pixels / 1e6:.2f} MP); at most "
                         f"{limits.max_pixels:,} ({limits.max_pixels / 1e6:.2f} MP) are allowed", field)
    totals.pixels += pixels * frames
    if totals.pixels > limits.max_total_pixels:
        raise _too_large(f"brings the request's images and frames to {totals.pixels:,} pixels; at most "
                         f"{limits.max_total_pixels:,} are allowed in all", field)


def _count_bytes(n: int, field: str, limits: MediaLimits, totals: _Totals) -> None:
    if n > limits.max_item_bytes:
        raise _too_large(f"has {_mib(n)}; at most {_mib(limits.max_item_bytes)} per item are allowed", field)
    totals.bytes += n
    if totals.bytes > limits.max_total_bytes:
        raise _too_large(f"brings the request's media to {_mib(totals.bytes)}; at most "
                         f"{_mib(limits.max_total_bytes)} are allowed in all", field)


def _digest(parts: Sequence[bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _image_item(entry: Any, field: str, limits: MediaLimits, local: bool, totals: _Totals, kind: str = "image",
                animated: bool = False) -> MediaItem:
    source, declared = _entry_bytes(entry, field, limits, local)
    if not isinstance(source, bytes):                       # a PIL.Image given offline
        width, height = source.size
        frames = getattr(source, "n_frames", 1) if animated else 1
        _check_pixels(width, height, frames, field, limits, totals)
        return MediaItem(kind, field, "Image", width, height, frames, (source,),
                         _digest([source.mode.encode(), f"{width}x{height}".encode(), source.tobytes()]))
    _count_bytes(len(source), field, limits, totals)
    image = _open(source, field, limits, declared)
    try:
        width, height = image.size
        try:
            frames = int(getattr(image, "n_frames", 1)) if animated else 1
        except Exception as exc:  # noqa: BLE001 - counting frames walks the file: a corrupt one raises anything
            raise _invalid(f"has corrupt frames ({type(exc).__name__})", field) from None
        if frames > limits.max_video_frames:
            raise _too_large(f"has {frames} frames; at most {limits.max_video_frames} are allowed", field)
        _check_pixels(width, height, frames, field, limits, totals)
        return MediaItem(kind, field, image.format, width, height, frames, (source,), _digest([source]))
    finally:
        image.close()


def _video_item(entry: Any, field: str, limits: MediaLimits, local: bool, totals: _Totals) -> MediaItem:
    """A video: an array of frames (each an image entry, all of one size) or one animated GIF/WebP/PNG."""
    if not isinstance(entry, (list, tuple)):
        if isinstance(entry, str) and entry[:256].lstrip()[:11].lower() == "data:video/":
            raise _invalid("video files are not decoded by this server: send a video as an array of frames "
                           "(data: URIs of images) or as one animated GIF/WebP/PNG", field)
        return _image_item(entry, field, limits, local, totals, kind="video", animated=True)
    if not entry:
        raise _invalid("a video needs at least one frame", field)
    if len(entry) > limits.max_video_frames:
        raise _too_large(f"has {len(entry)} frames; at most {limits.max_video_frames} are allowed", field)
    frames = [_image_item(f, f"{field}[{i}]", limits, local, totals) for i, f in enumerate(entry)]
    first = frames[0]
    for frame in frames[1:]:
        if (frame.width, frame.height) != (first.width, first.height):
            raise _invalid(f"is {frame.width}x{frame.height} but the video's first frame is "
                           f"{first.width}x{first.height}; all frames must have one size", frame.field)
    nbytes = sum(f.nbytes for f in frames)
    if nbytes > limits.max_item_bytes:
        raise _too_large(f"has {_mib(nbytes)} of frames; at most {_mib(limits.max_item_bytes)} per item are allowed",
                         field)
    sources = tuple(s for f in frames for s in f.sources)
    return MediaItem("video", field, first.format if len({f.format for f in frames}) == 1 else "mixed", first.width,
                     first.height, len(frames), sources, _digest([f.digest.encode() for f in frames]))


def parse_media(images: Any, videos: Any, limits: MediaLimits = DEFAULT_MEDIA_LIMITS, *,
                local: bool = False) -> list[MediaItem]:
    """Validate a request's ``images`` and ``videos`` (``None`` or arrays) from their bytes and headers:
    images first, then videos, in order. ``local`` (the offline API): entries may also be bytes, local paths
    or ``PIL.Image`` objects. No pixel is decoded here (:func:`decode_media` does)."""
    if videos and not limits.videos:                # (an empty array or null is no media, as before)
        raise RequestError("unknown field (this dialect takes no videos)", field="videos")
    items: list[MediaItem] = []
    totals = _Totals()
    for key, entries, cap in (("images", images, limits.max_images), ("videos", videos, limits.max_videos)):
        if entries is None:
            continue
        if not isinstance(entries, (list, tuple)):
            raise RequestError("must be an array", field=key)
        if len(entries) > cap:
            raise _invalid(f"at most {cap} {key} are allowed, got {len(entries)}", f"{key}[{cap}]")
        for i, entry in enumerate(entries):
            field = f"{key}[{i}]"
            make = _image_item if key == "images" else _video_item
            items.append(make(entry, field, limits, local, totals))
    return items


# --------------------------------------------------------------------------- pixels


def no_check() -> None:
    """A checkpoint that never stops the work."""


def _frames(item: MediaItem, check: Callable[[], None]):
    """Each decoded frame of ``item`` (an image: its first frame), one at a time."""
    from PIL import Image

    if item.format == "Image":
        yield from item.sources
        return
    for source in item.sources:
        image = Image.open(io.BytesIO(source), formats=[item.format] if item.format != "mixed" else list(FORMAT_NAMES))
        try:
            count = item.frames if len(item.sources) == 1 and item.kind == "video" else 1
            for index in range(count):
                check()
                if index:
                    image.seek(index)
                image.load()
                yield image
        finally:
            image.close()


def decode_media(items: Sequence[MediaItem], check: Callable[[], None] | None = None) -> None:
    """Decode every frame of ``items`` once (and check PNG checksums), so that truncated or corrupt data is
    refused (:attr:`Kind.MEDIA_INVALID`) before a request is queued. The pixels are dropped again.
    ``check`` is called between frames (it raises to stop the work)."""
    from PIL import Image

    check = check or no_check
    for item in items:
        if item.format == "PNG":
            for source in item.sources:
                try:
                    with Image.open(io.BytesIO(source), formats=["PNG"]) as image:
                        image.verify()
                except Exception as exc:  # noqa: BLE001 - reported per entry
                    raise _invalid(f"is truncated or corrupt ({_reason(exc)})", item.field) from None
        frames = _frames(item, check)
        try:
            for _ in frames:
                pass
        except ClefError:                   # the request was cancelled (check)
            raise
        except Exception as exc:  # noqa: BLE001 - Pillow's decoders raise many types on hostile data
            raise _invalid(f"is truncated or corrupt ({_reason(exc)})", item.field) from None
        finally:
            frames.close()


def _reason(exc: BaseException) -> str:
    text = str(exc)[:160]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def media_key(items: Sequence[MediaItem]) -> str:
    """The request key of the first media entry (``images`` or ``videos``), for the text-only refusal."""
    return items[0].field.split("[", 1)[0] if items else "images"


# --------------------------------------------------------------------------- media tokens typed as text
#
# The Qwen3.5 tokenizer recognises its added tokens anywhere in a text (``split_special_tokens`` false), so
# ``"<|image_pad|>"`` typed inside a state or a question would become id 248056, the placeholder the processor
# expands into an image's tokens: text could forge a placeholder. :class:`TypedMediaTokens` encodes the four
# media tokens (``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``) as the tokens of
# their own text instead: the text is split where the tokenizer itself splits around an added token, each part is
# tokenized as before, and the literal gets the ids its characters have as plain text (normalizer, pre-tokenizer
# and BPE model, as if it were not an added token). Every other id is unchanged; the prompt's own special tokens
# (``<|im_start|>`` ...) are untouched.

#: The media tokens of Qwen3.5's vocabulary and their ids (docs/encoding-and-head.md, "Media").
MEDIA_TOKENS = {"<|vision_start|>": 248053, "<|vision_end|>": 248054, "<|image_pad|>": 248056, "<|video_pad|>": 248057}


class TypedMediaTokens:
    """Tokenizes texts with ``tok`` (a ``tokenizers.Tokenizer``), the media tokens typed in them as text."""

    def __init__(self, tok):
        self._tok = tok
        try:
            added = {t.content for t in tok.get_added_tokens_decoder().values()}
        except AttributeError:
            added = set()
        tokens = [t for t in MEDIA_TOKENS if t in added]
        self.pattern = re.compile("|".join(map(re.escape, tokens))) if tokens else None
        self.text_ids = {t: self._as_text(t) for t in tokens}
        #: The ids the media tokens have in this tokenizer: never produced from text.
        self.ids = frozenset(tok.token_to_id(t) for t in tokens)

    def _as_text(self, literal: str) -> list[int]:
        tok = self._tok
        text = tok.normalizer.normalize_str(literal) if tok.normalizer is not None else literal
        pieces = tok.pre_tokenizer.pre_tokenize_str(text) if tok.pre_tokenizer is not None else [(text, None)]
        return [t.id for piece, _ in pieces for t in tok.model.tokenize(piece)]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added (as ``Tokenizer.encode_batch``)."""
        texts = list(texts)
        pattern = self.pattern
        typed = [] if pattern is None else [i for i, t in enumerate(texts) if "<|" in t and pattern.search(t)]
        if not typed:
            return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        out = [None] * len(texts)
        skip = set(typed)
        plain = [i for i in range(len(texts)) if i not in skip]
        for i, e in zip(plain, self._tok.encode_batch([texts[i] for i in plain], add_special_tokens=False)):
            out[i] = e.ids
        for i in typed:
            parts = pattern.split(texts[i])            # text between the literals
            literals = pattern.findall(texts[i])
            encoded = self._tok.encode_batch(parts, add_special_tokens=False)
            ids = list(encoded[0].ids)
            for literal, part in zip(literals, encoded[1:]):
                ids += self.text_ids[literal]
                ids += part.ids
            out[i] = ids
        return out


#: Why a server without an image processor refuses media, unless it says more.
TEXT_ONLY = "this server runs text-only"


def text_only(items: Sequence[MediaItem], why: str = TEXT_ONLY) -> RequestError:
    """The refusal of a request with validated media by a server that does not serve them (400), saying why."""
    return media_refused(why, media_key(items))


def media_refused(why: str, field: str = "images") -> RequestError:
    """The 400 for media a server does not serve (also a backend's, for an encoded request carrying images)."""
    return RequestError(f"not served: {why}", kind=Kind.UNSUPPORTED, field=field)


__all__ = ["DEFAULT_MEDIA_LIMITS", "HOSTED_MAX_BODY_BYTES", "WORKERS_AI_MEDIA_LIMITS", "MEDIA_KEYS", "MediaItem", "MediaLimits",
           "MEDIA_TOKENS", "TEXT_ONLY", "TypedMediaTokens", "decode_media", "media_key", "media_refused", "no_check",
           "parse_media", "text_only"]
