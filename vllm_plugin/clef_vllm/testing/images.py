"""Image entries built for the media tests and ``bench/soak.py``'s media mix: pictures in any Pillow format,
``data:`` URIs, and a PNG whose header declares more pixels than it holds (a decompression bomb)."""

from __future__ import annotations

import base64
import io
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


__all__ = ["data_uri", "image_bytes", "noisy", "png_declaring"]
