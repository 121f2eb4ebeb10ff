"""Images from chat messages: data URI -> checked PIL image -> normalised pixels -> content hash.

Every way a client can get an image wrong ends here as an :class:`InvalidRequestError` whose
message says what is wrong, before any model work is spent on it::

    "data:image/png;base64,iVBOR..."
        | decode_data_uri   prefix, media type, size, base64, format, pixel count, truncation
        v
    PIL image (EXIF-rotated)
        | preprocess        alpha over white -> RGB -> bicubic SxS -> [0, 1] -> CLIP mean/std
        v
    float32 [3, S, S]
        | image_hash        sha256(tag | shape | pixel bytes)
        v
    32-byte digest: an extra key of the KV blocks the image's placeholder tokens sit in

A LLaVA model (``llava.py``) preprocesses with its own image processor instead, and hashes with
:func:`pixel_hash`: the decoded RGB pixels, the processor's settings and the tower's identity.

Hashing pixels rather than the upload means that a PNG and a lossless
re-encoding of the same picture (or the same picture with different metadata) share one hash,
and so share cached embeddings and KV blocks.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import struct

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from services.common.errors import InvalidRequestError

MAX_IMAGE_BYTES = 20 * 1024 * 1024
"""Largest decoded upload accepted (the base64 text is a third larger)."""

MAX_IMAGE_PIXELS = 36_000_000
"""Largest width x height accepted (6000 x 6000): a tiny compressed file can claim a huge canvas,
and decoding it would take width x height x 4 bytes. Below Pillow's own warning threshold
(~89 M pixels), so our check is the one that fires for ordinary oversized images."""

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

_MEAN = np.array(CLIP_MEAN, dtype=np.float32)
_STD = np.array(CLIP_STD, dtype=np.float32)

PREPROCESS_TAG = b"epd-image-v1|alpha-over-white|rgb|bicubic|unit|clip-mean-std|float32"
"""Names the preprocessing in every image hash: change the pipeline, change this tag, so old
hashes (and the KV blocks keyed by them) stop matching instead of silently meaning new pixels."""

_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_DATA_URI = re.compile(r"data:(?P<media>[^;,]*)(?P<params>(;[^;,]*)*),", re.IGNORECASE)
_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")


def decode_data_uri(uri: str, max_bytes: int = MAX_IMAGE_BYTES,
                    max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """The fully loaded image of a ``data:image/<png|jpeg|webp|gif>;base64,...`` URI.

    The declared media type is checked against the accepted list, but the bytes may be any of
    the accepted formats: clients often label a JPEG as image/png, and the decoder knows better.
    """
    payload = _base64_payload(uri)
    # Checked on the text so an oversized upload is rejected before a byte of it is decoded.
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise InvalidRequestError(
            f"image is about {len(payload) // 4 * 3} bytes, over the {max_bytes}-byte limit")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"image data is not valid base64: {exc}") from exc
    if len(data) > max_bytes:
        raise InvalidRequestError(f"image is {len(data)} bytes, over the {max_bytes}-byte limit")
    return _open_image(data, max_pixels)


def _base64_payload(uri: str) -> str:
    if not isinstance(uri, str):
        raise InvalidRequestError(f"image URL must be a string, got {type(uri).__name__}")
    if uri[:8].lower().startswith(("http://", "https://")):
        raise InvalidRequestError(
            "remote image URLs are not fetched; send the image inline as data:image/...;base64,...")
    match = _DATA_URI.match(uri)
    if match is None:
        raise InvalidRequestError(
            f"image URL must be a data URI (data:image/<png|jpeg|webp|gif>;base64,...), "
            f"got {uri[:32]!r}")
    media = match["media"].strip().lower()
    if media not in _MEDIA_TYPES:
        raise InvalidRequestError(
            f"unsupported image media type {media or '(none)'!r}; expected one of "
            f"{', '.join(_MEDIA_TYPES)}")
    if "base64" not in (p.strip().lower() for p in match["params"].split(";")):
        raise InvalidRequestError("image data URI must be base64-encoded (;base64,)")
    # Clients that wrap base64 at 76 columns are common; whitespace carries no data.
    return "".join(uri[match.end():].split())


def _open_image(data: bytes, max_pixels: int) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data), formats=_FORMATS)
    except UnidentifiedImageError as exc:
        raise InvalidRequestError("image data is not a PNG, JPEG, WebP or GIF image") from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own guard (open() reads only the header): a claimed canvas far past ours.
        raise InvalidRequestError(f"image has too many pixels (limit {max_pixels}): {exc}") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise InvalidRequestError(f"image header is corrupt: {exc}") from exc
    width, height = image.size
    if width * height > max_pixels:
        raise InvalidRequestError(
            f"image is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}")
    try:
        image.load()  # The header checked out; now the pixels, which is where truncation shows.
        # Phone JPEGs store "rotate me" in EXIF; the model should see the picture upright.
        ImageOps.exif_transpose(image, in_place=True)
        return image
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InvalidRequestError(f"{image.format} image data is truncated or corrupt: {exc}") from exc


def preprocess(image: Image.Image, image_size: int) -> torch.Tensor:
    """Normalised float32 pixels ``[3, image_size, image_size]`` on the CPU.

    The whole image is squashed to a square (no crop: nothing the user sent is cut away).
    Transparent areas go over white, as Hugging Face's ``convert_to_rgb`` does, rather than
    over whatever colour the transparent pixels happen to store (often black).
    """
    image = to_rgb(image).resize((image_size, image_size), Image.Resampling.BICUBIC)
    # numpy, not torch, for this arithmetic: torch splits even a 150k-element op over its
    # OpenMP pool, which costs milliseconds per image when the cores are busy with a forward.
    # Float32 throughout; each op is IEEE-exact, so the bytes (and the hash) match everywhere.
    pixels = np.asarray(image, dtype=np.float32) / np.float32(255.0)
    pixels = (pixels - _MEAN) / _STD  # [S, S, 3]
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB pixels of ``image``: alpha composited over white, 16-bit grey cut to its top 8 bits."""
    if image.mode.startswith("I"):
        # 16-bit grayscale PNG: Pillow's convert() would clip at 255 (nearly all white);
        # keep the top 8 bits instead.
        wide = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
        image = Image.fromarray((wide >> 8).astype(np.uint8))
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def image_hash(pixels: torch.Tensor) -> bytes:
    """32-byte sha256 of preprocessed pixels, stable across processes and machines.

    Only IEEE-exact elementwise ops (divide, subtract) produce ``pixels`` from 8-bit values,
    so every CPU computes the same float32 bytes. The shape is hashed with the tag because the
    same bytes could be read as a different image size.
    """
    assert pixels.dtype == torch.float32 and pixels.dim() == 3, "hash preprocess() output"
    h = hashlib.sha256(PREPROCESS_TAG)
    h.update(struct.pack("<3I", *pixels.shape))
    # Little-endian explicitly, so a big-endian host would hash the same picture the same way.
    h.update(pixels.detach().cpu().contiguous().numpy().astype("<f4", copy=False).tobytes())
    return h.digest()


PIXEL_HASH_TAG = b"epd-image-v2|rgb8"
"""Names :func:`pixel_hash`'s layout: change it, change this tag."""


def pixel_hash(rgb: Image.Image, settings: bytes, tower_id: bytes) -> bytes:
    """32-byte sha256 of decoded RGB pixels (``to_rgb``'s output), the preprocessing settings
    that will turn them into the model's input, and the tower that will read them.

    Needs only Pillow, numpy and hashlib, so it can run before preprocessing (and wherever an
    image's hash is wanted before the encoder sees it). Each part is length-prefixed, so no
    two different (settings, tower, pixels) triples hash the same bytes.
    """
    assert rgb.mode == "RGB", "hash to_rgb() output"
    h = hashlib.sha256(PIXEL_HASH_TAG)
    for part in (settings, tower_id):
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    h.update(struct.pack("<2I", *rgb.size))
    h.update(np.asarray(rgb, dtype=np.uint8).tobytes())
    return h.digest()
