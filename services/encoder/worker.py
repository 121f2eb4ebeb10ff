"""The encoder worker: data URIs in, one embedding row per image placeholder token out.

All images of one call are validated first (a bad one fails the call before any compute), then
deduplicated by content hash and encoded in one batched forward. Embeddings come back as float32
on the CPU whatever the compute device and dtype, ready for :func:`to_bytes` and the wire.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from services.common.errors import InvalidRequestError
from services.encoder.images import decode_data_uri, image_hash, preprocess
from services.encoder.vision import VisionConfig, VisionTower
from services.engine.model_runner import resolve_device, resolve_dtype

# The wire format is raw little-endian; torch's in-memory layout is host order. Every platform
# torch ships for is little-endian, so this is a tripwire rather than a code path.
assert sys.byteorder == "little", "embedding wire bytes assume a little-endian host"

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Dtypes an embedding may travel in; bf16 halves the bytes at ~3 significant digits."""


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no single truth value to compare
class ImageEmbedding:
    image_hash: bytes
    """sha256 of the preprocessed pixels (see images.image_hash); joins the KV block hashes."""
    embeddings: torch.Tensor
    """float32 CPU ``[num_patches, out_hidden_size]``, one row per placeholder token."""
    num_patches: int


class RawTensor(NamedTuple):
    """A tensor as the wire carries it: raw little-endian bytes, shape, dtype name."""

    data: bytes
    shape: tuple[int, ...]
    dtype: str


class EncoderWorker:
    def __init__(self, config: VisionConfig, device: str = "auto", dtype: str = "auto") -> None:
        if not (device in ("auto", "cpu", "cuda") or device.startswith("cuda:")):
            raise InvalidRequestError(f"encoder device={device!r}: must be auto, cpu or cuda[:N]")
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise InvalidRequestError(
                f"encoder dtype={dtype!r}: must be auto, float32, bfloat16 or float16")
        self.config = config
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        # Weights are made (or loaded) in fp32 on the CPU first, so the random init is the
        # same bits on every machine; only then cast and moved.
        self.model = VisionTower(config).to(device=self.device, dtype=self.dtype).eval()

    @property
    def num_patches_per_image(self) -> int:
        """Embedding rows per image: the number of placeholder tokens the prompt needs for it."""
        return self.config.num_patches

    def encode(self, data_uris: Sequence[str]) -> list[ImageEmbedding]:
        """One embedding per URI, in order; InvalidRequestError (naming the image) if any is bad."""
        pixels, hashes = [], []
        for i, uri in enumerate(data_uris):
            try:
                image = decode_data_uri(uri)
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"image {i}: {exc}") from exc
            pixels.append(preprocess(image, self.config.image_size))
            hashes.append(image_hash(pixels[-1]))
        if not pixels:
            return []
        # The same picture twice in one request (a common retry/quote pattern) is encoded once.
        unique = list(dict.fromkeys(hashes))
        first = {h: hashes.index(h) for h in unique}
        batch = torch.stack([pixels[first[h]] for h in unique])
        # Cloned outside inference mode: each image gets its own storage (not a view of the
        # batch) and a normal tensor that autograd-tracked code may use.
        rows = dict(zip(unique, (row.clone() for row in self._forward(batch))))
        n = self.num_patches_per_image
        return [ImageEmbedding(image_hash=h, embeddings=rows[h], num_patches=n) for h in hashes]

    @torch.inference_mode()
    def _forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(batch.to(device=self.device, dtype=self.dtype)).to("cpu", torch.float32)


def to_bytes(embeddings: torch.Tensor, dtype: str = "float32") -> RawTensor:
    """Raw little-endian bytes of ``embeddings`` cast to ``dtype`` (float32 or bfloat16)."""
    if dtype not in WIRE_DTYPES:
        raise InvalidRequestError(f"embedding wire dtype {dtype!r}: must be one of {list(WIRE_DTYPES)}")
    t = embeddings.detach().to(device="cpu", dtype=WIRE_DTYPES[dtype]).contiguous()
    # A uint8 view, because numpy has no bfloat16; host order is little-endian (asserted above).
    return RawTensor(t.view(torch.uint8).numpy().tobytes(), tuple(t.shape), dtype)


def from_bytes(data: bytes, shape: Sequence[int], dtype: str) -> torch.Tensor:
    """The float32 CPU tensor that :func:`to_bytes` encoded; InvalidRequestError if inconsistent."""
    if dtype not in WIRE_DTYPES:
        raise InvalidRequestError(f"embedding wire dtype {dtype!r}: must be one of {list(WIRE_DTYPES)}")
    wire = WIRE_DTYPES[dtype]
    expected = math.prod(shape) * wire.itemsize
    if any(d < 0 for d in shape) or len(data) != expected:
        raise InvalidRequestError(
            f"embedding of shape {tuple(shape)} in {dtype} needs {expected} bytes, got {len(data)}")
    if not data:
        return torch.zeros(tuple(shape), dtype=torch.float32)
    # bytearray: frombuffer must not alias (or warn about) immutable bytes.
    return torch.frombuffer(bytearray(data), dtype=wire).reshape(tuple(shape)).to(torch.float32)
