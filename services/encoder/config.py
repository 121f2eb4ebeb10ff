"""Encoder service settings: every field a --flag and an EPD_ENCODER_* variable."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import check
from services.common.server import ServerOptions


@dataclass(frozen=True)
class EncoderConfig(ServerOptions):
    """An encoder instance: images in, embeddings for the language model out."""

    model: str = ""
    """The language model the embeddings are for (its hidden size); empty: SmolLM2-135M-Instruct."""
    weights: str = ""
    """Local .safetensors weights of the vision tower; empty: deterministic random init."""
    seed: int = 0
    """Seed of the random init (the same seed gives the same tower in every process)."""
    image_size: int = 224
    """Side of the square every image is resized to."""
    patch_size: int = 16
    """Side of one patch: each patch is one embedding row, one placeholder token."""
    device: str = "auto"
    """"cpu", "cuda" or "auto"."""
    max_images_per_request: int = 8
    """Most images in one request."""
    port: int = 50051
    """gRPC port; 0 picks a free one."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.image_size > 0 and self.patch_size > 0 and self.image_size % self.patch_size == 0,
              "image_size", "must be a positive multiple of patch_size")
        check(self.max_images_per_request > 0, "max_images_per_request", "must be > 0")
