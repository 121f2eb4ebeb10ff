"""In-memory test pictures and the data URIs a chat client would send for them."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def noise_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """Random pixels: every picture differs, and bicubic resizing cannot blur two into one."""
    channels = len(mode)
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode=mode)


def encode(image: Image.Image, fmt: str = "PNG", **save_args) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **save_args)
    return out.getvalue()


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_uri(image: Image.Image, fmt: str = "PNG", **save_args) -> str:
    return data_uri(encode(image, fmt, **save_args), f"image/{fmt.lower()}")


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims a ``width x height`` canvas but holds almost no data: a decompression
    bomb's header, which is all the decoder reads before our pixel check has to fire."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16))
            + chunk(b"IEND", b""))
