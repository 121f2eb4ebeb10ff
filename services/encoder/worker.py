"""The encoder worker: data URIs in, one embedding row per image placeholder token out.

All images of one call are validated first (a bad one fails the call before any compute), then
deduplicated by content hash and encoded in one batched forward. Embeddings come back as float32
on the CPU whatever the compute device and dtype, ready for :func:`to_bytes` and the wire.

The images of a call are decoded, preprocessed and hashed side by side on a small thread pool
(Pillow, numpy and hashlib release the GIL): on an accelerator that per-image CPU work, not the
forward, is what a batched call waits on (see benchmarks/encoder.py).
"""

from __future__ import annotations

import math
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from services.common.errors import InvalidRequestError
from services.encoder.images import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, decode_data_uri
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
    embeddings: torch.Tensor | None
    """float32 CPU ``[num_patches, out_hidden_size]``, one row per placeholder token; None for
    an image the caller said it has (``encode``'s ``is_cached``): the tower skipped it."""
    num_patches: int


class RawTensor(NamedTuple):
    """A tensor as the wire carries it: raw little-endian bytes, shape, dtype name."""

    data: bytes
    shape: tuple[int, ...]
    dtype: str


class EncoderWorker:
    max_image_bytes = MAX_IMAGE_BYTES  # issue 20: the service sets its --max-image-* flags here
    max_image_pixels = MAX_IMAGE_PIXELS

    def __init__(self, config: VisionConfig | None = None, device: str = "auto", dtype: str = "auto",
                 model=None) -> None:
        """``model``: the vision model to run (issue 20: a ``llava.LlavaVision``; anything with
        ``num_image_tokens``, ``prepare(image) -> (pixels, hash)`` and ``forward(batch)``);
        None: the home-made tower of ``config``."""
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
        model = model if model is not None else VisionTower(config)  # issue 20
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        # As many as torch's threads: the cores this process was given for the forward, which
        # waits for these anyway. Threads are started on first use, so a batch-1 call starts none.
        self._prepare_pool = ThreadPoolExecutor(max(1, torch.get_num_threads()),
                                                thread_name_prefix="encoder-prepare")

    @property
    def num_patches_per_image(self) -> int:
        """Embedding rows per image: the number of placeholder tokens the prompt needs for it."""
        return self.model.num_image_tokens  # issue 20: from the model, not a constant

    def encode(self, data_uris: Sequence[str],
               is_cached: Callable[[bytes], bool] | None = None) -> list[ImageEmbedding]:
        """One embedding per URI, in order; InvalidRequestError (naming the image) if any is bad.

        ``is_cached(image_hash)``: True for an image whose rows the caller holds (an embedding
        cache); the forward pass skips it and its ImageEmbedding has no embeddings."""
        if not data_uris:
            return []
        if len(data_uris) == 1:
            prepared = [self._prepare(0, data_uris[0])]
        else:  # map yields in order: the lowest-numbered bad image is the one reported
            prepared = list(self._prepare_pool.map(self._prepare, range(len(data_uris)), data_uris))
        pixels, hashes = [p for p, _ in prepared], [h for _, h in prepared]
        # The same picture twice in one request (a common retry/quote pattern) is encoded once.
        unique = [h for h in dict.fromkeys(hashes) if is_cached is None or not is_cached(h)]
        first = {h: hashes.index(h) for h in unique}
        rows: dict[bytes, torch.Tensor] = {}
        if unique:
            batch = torch.stack([pixels[first[h]] for h in unique])
            # Cloned outside inference mode: each image gets its own storage (not a view of the
            # batch) and a normal tensor that autograd-tracked code may use.
            rows = dict(zip(unique, (row.clone() for row in self._forward(batch))))
        n = self.num_patches_per_image
        return [ImageEmbedding(image_hash=h, embeddings=rows.get(h), num_patches=n) for h in hashes]

    def _prepare(self, index: int, uri: str) -> tuple[torch.Tensor, bytes]:
        """One image's pixels (the model's preprocessing) and hash; InvalidRequestError naming it."""
        try:
            image = decode_data_uri(uri, self.max_image_bytes, self.max_image_pixels)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"image {index}: {exc}") from exc
        return self.model.prepare(image)  # issue 20: the model's preprocessing

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
