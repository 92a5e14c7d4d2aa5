"""Image entries built for the media tests, the GPU parity run and ``bench/soak.py``'s media mix: pictures in any
Pillow format, ``data:`` URIs, a PNG whose header declares more pixels than it holds (a decompression bomb), and
requests with 0-4 images of varied sizes, formats and modes, and requests with a video (its frames, or an animated
GIF)."""

from __future__ import annotations

import base64
import io
import random
import struct
import zlib


def image_bytes(fmt: str = "PNG", size=(8, 8), color="red", **save) -> bytes:
    """A plain picture of ``size`` in ``fmt``."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, fmt, **save)
    return out.getvalue()


def noisy(fmt: str, size=(64, 64)) -> bytes:
    """A noisy picture of ``size`` in ``fmt`` (every patch differs; a prefix of it is a truncated file)."""
    from PIL import Image

    out = io.BytesIO()
    Image.effect_noise(size, 64).convert("RGB").save(out, fmt)
    return out.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def png_declaring(width: int, height: int) -> bytes:
    """A valid-looking PNG of a few hundred bytes whose header declares width x height RGB pixels."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 4096)) + chunk(b"IEND", b""))


QUESTIONS = {"urgent": {"type": "noul", "instructions": "Does the picture show an outage?"},
             "kind": {"type": "choice", "criteria": {"invoice": "A scanned invoice", "error": "An error screen",
                                                     "photo": None}},
             "severity": {"type": "score", "criteria": ["none", "low", "high"]}}


def picture(size: tuple[int, int], seed: int, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """A noisy picture (so that every patch differs) in ``fmt``."""
    from PIL import Image

    rng = random.Random(seed)
    img = Image.effect_noise(size, 40 + seed % 30).convert(mode)
    img.paste((rng.randrange(256), rng.randrange(256), rng.randrange(256))[:len(mode)] if mode != "L" else 128,
              (0, 0, size[0] // 2, size[1] // 3))
    out = io.BytesIO()
    img.save(out, fmt)
    return out.getvalue()


#: Sizes and aspect ratios: below the processor's 65,536-pixel floor (scaled up), tall, wide, square, odd.
SIZES = [(40, 40), (300, 120), (64, 512), (257, 255), (530, 530), (90, 700)]


def image_requests(n: int, seed: int = 0, max_images: int = 4) -> list[dict]:
    """``n`` requests with 0 to ``max_images`` images each (PNG, JPEG, WebP, RGBA and grey PNGs), varied states."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        images = []
        for j in range(i % (max_images + 1)):
            fmt, mime, mode = rng.choice([("PNG", "image/png", "RGB"), ("JPEG", "image/jpeg", "RGB"),
                                          ("WEBP", "image/webp", "RGB"), ("PNG", "image/png", "RGBA"),
                                          ("PNG", "image/png", "L")])
            images.append(data_uri(picture(rng.choice(SIZES), seed * 100 + i * 10 + j, fmt, mode), mime))
        state = " ".join(rng.choice(["error", "checkout", "invoice", "429", "blank", "screen"]) for _ in range(5 + i))
        out.append({"model": "clef-flash", "state": state, "questions": QUESTIONS, "images": images})
    return out


def video_frames(size: tuple[int, int], n: int, seed: int, fmt: str = "PNG") -> list[str]:
    """A video as the wire takes it: ``n`` noisy frames of ``size``, each a ``data:`` URI in ``fmt``."""
    return [data_uri(picture(size, seed * 100 + k, fmt), f"image/{fmt.lower()}") for k in range(n)]


def animated_gif(size: tuple[int, int], n: int, seed: int) -> str:
    """A video as one animated GIF of ``n`` noisy frames, as a ``data:`` URI."""
    from PIL import Image

    frames = [Image.open(io.BytesIO(picture(size, seed * 100 + k))).convert("RGB") for k in range(n)]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return data_uri(out.getvalue(), "image/gif")


#: Video frame sizes: small, tall, wide, and one whose frames the processor scales up.
VIDEO_SIZES = [(64, 48), (96, 64), (160, 120), (48, 200), (320, 240), (40, 40)]


def video_requests(n: int, seed: int = 0) -> list[dict]:
    """``n`` requests with one video each (2 to 9 PNG or JPEG frames, every fifth an animated GIF) after 0 to 2
    images, varied states."""
    rng = random.Random(seed)
    out = []
    for i, body in enumerate(image_requests(n, seed, max_images=2)):
        size, frames = rng.choice(VIDEO_SIZES), rng.randint(2, 9)
        video = (animated_gif(size, frames, seed * 1000 + i) if i % 5 == 4
                 else video_frames(size, frames, seed * 1000 + i, rng.choice(["PNG", "JPEG"])))
        out.append(body | {"videos": [video]})
    return out


__all__ = ["QUESTIONS", "SIZES", "VIDEO_SIZES", "animated_gif", "data_uri", "image_bytes", "image_requests", "noisy",
           "picture", "png_declaring", "video_frames", "video_requests"]
