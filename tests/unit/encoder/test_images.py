"""Data URIs in, checked images out; preprocessing; the image hash contract."""

from __future__ import annotations

import base64

import pytest
import torch
from PIL import Image, PngImagePlugin

from services.common.errors import InvalidRequestError
from services.encoder.images import CLIP_MEAN, CLIP_STD, decode_data_uri, image_hash, preprocess
from tests.unit.encoder.images_factory import (data_uri, encode, image_uri, noise_image,
                                               png_header_only)


def pixels_of(uri: str, size: int = 32) -> torch.Tensor:
    return preprocess(decode_data_uri(uri), size)


@pytest.mark.parametrize("fmt, media", [("PNG", "png"), ("JPEG", "jpeg"), ("WEBP", "webp"),
                                        ("GIF", "gif"), ("JPEG", "jpg")])
def test_every_accepted_format_decodes(fmt, media):
    data = encode(noise_image(37, 21), fmt)
    image = decode_data_uri(data_uri(data, f"image/{media}"))
    assert image.format == fmt and image.size == (37, 21)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "1"])
@pytest.mark.parametrize("size", [(1, 1), (37, 501), (640, 9)])
def test_preprocess_shape_and_range(mode, size):
    pixels = pixels_of(image_uri(noise_image(*size, seed=3).convert(mode)), 48)
    assert pixels.shape == (3, 48, 48) and pixels.dtype == torch.float32
    mean, std = torch.tensor(CLIP_MEAN).view(3, 1, 1), torch.tensor(CLIP_STD).view(3, 1, 1)
    assert (pixels >= -mean / std - 1e-5).all() and (pixels <= (1 - mean) / std + 1e-5).all()


def test_transparent_pixels_go_over_white():
    clear = Image.new("RGBA", (10, 10), (0, 0, 0, 0))
    white = Image.new("RGB", (10, 10), (255, 255, 255))
    assert torch.equal(pixels_of(image_uri(clear)), pixels_of(image_uri(white)))


def test_sixteen_bit_grayscale_keeps_its_top_byte():
    wide = (torch.arange(600, dtype=torch.int32).view(20, 30) * 100).numpy().astype("uint16")
    narrow = (wide >> 8).astype("uint8")
    assert torch.equal(pixels_of(image_uri(Image.fromarray(wide))),
                       pixels_of(image_uri(Image.fromarray(narrow))))


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    image = decode_data_uri(image_uri(noise_image(40, 20), "JPEG", exif=exif))
    assert image.size == (20, 40)


def test_same_pixels_in_any_lossless_encoding_hash_the_same():
    picture = noise_image(123, 77, seed=1)
    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "re-encoded by a different client")
    uris = [image_uri(picture), image_uri(picture, compress_level=0, pnginfo=info),
            image_uri(picture, "WEBP", lossless=True), image_uri(picture.convert("RGBA"))]
    hashes = {image_hash(pixels_of(uri, 224)) for uri in uris}
    assert len(hashes) == 1 and len(hashes.pop()) == 32


def test_different_pictures_and_sizes_hash_differently():
    a, b = image_uri(noise_image(64, 64, seed=1)), image_uri(noise_image(64, 64, seed=2))
    assert image_hash(pixels_of(a)) != image_hash(pixels_of(b))
    assert image_hash(pixels_of(a, 32)) != image_hash(pixels_of(a, 64))


def test_image_hash_golden_vector():
    # Pins the preprocessing (Pillow's bicubic, CLIP mean/std, float32, tag): if this changes,
    # every image hash, and every KV block keyed by one, changes with it. Bump PREPROCESS_TAG.
    # (test_worker checks that a fresh process computes the same.)
    gradient = Image.linear_gradient("L").resize((40, 30)).convert("RGB")
    assert image_hash(preprocess(gradient, 16)).hex() == GOLDEN_HASH


GOLDEN_HASH = "1bb6f5012b7c3a5aad36d93cc5e43da70813e9ec5adcd3d7f92f102849b373a6"


PNG = encode(noise_image(50, 40), "PNG")
JPEG = encode(noise_image(50, 40), "JPEG")


@pytest.mark.parametrize("uri, message", [
    ("https://example.com/cat.png", "remote image URLs are not fetched"),
    ("http://example.com/cat.png", "remote image URLs are not fetched"),
    ("cat.png", "must be a data URI"),
    ("data:text/plain;base64,aGVsbG8=", "unsupported image media type 'text/plain'"),
    ("data:image/bmp;base64,Qk0=", "unsupported image media type 'image/bmp'"),
    ("data:image/png,rawbytes", "must be base64-encoded"),
    ("data:image/png;base64,iVBOR!!!", "not valid base64"),
    ("data:image/png;base64,iVBORw0", "not valid base64"),
    (data_uri(b"hello, world"), "not a PNG, JPEG, WebP or GIF image"),
    (data_uri(encode(noise_image(8, 8), "BMP")), "not a PNG, JPEG, WebP or GIF image"),
    (data_uri(PNG[: len(PNG) // 2]), "PNG image data is truncated or corrupt"),
    (data_uri(JPEG[: len(JPEG) // 2], "image/jpeg"), "JPEG image data is truncated or corrupt"),
    (data_uri(png_header_only(7000, 7000)), "7000x7000 = 49000000 pixels, over the limit of 36000000"),
    (data_uri(png_header_only(100_000, 100_000)), "too many pixels"),
])
def test_bad_input_says_what_is_wrong(uri, message):
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        decode_data_uri(uri)


def test_non_string_is_rejected():
    with pytest.raises(InvalidRequestError, match="must be a string, got NoneType"):
        decode_data_uri(None)


def test_size_and_pixel_limits():
    uri = data_uri(PNG)
    with pytest.raises(InvalidRequestError, match=f"over the {len(PNG) - 1}-byte limit"):
        decode_data_uri(uri, max_bytes=len(PNG) - 1)
    with pytest.raises(InvalidRequestError, match="over the 100-byte limit"):  # caught on the text
        decode_data_uri(uri, max_bytes=100)
    assert decode_data_uri(uri, max_bytes=len(PNG)).size == (50, 40)
    with pytest.raises(InvalidRequestError, match="50x40 = 2000 pixels, over the limit of 1999"):
        decode_data_uri(uri, max_pixels=1999)


def test_wrapped_base64_and_mislabelled_type_are_accepted():
    text = base64.b64encode(JPEG).decode()
    wrapped = "\n".join(text[i:i + 76] for i in range(0, len(text), 76))
    assert decode_data_uri(f"DATA:Image/PNG;base64,{wrapped}").format == "JPEG"
