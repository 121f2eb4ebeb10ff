"""Encoder service settings: every field a --flag and an EPD_ENCODER_* variable."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import check
from services.common.server import ServerOptions


@dataclass(frozen=True)
class EncoderConfig(ServerOptions):
    """An encoder instance: images in, embeddings for the language model out."""

    model: str = ""
    """The model the embeddings are for: a LLaVA directory (its vision tower, projector and image
    processor run here), or a text model (the home-made tower is sized for its hidden size);
    empty: SmolLM2-135M-Instruct."""
    weights: str = ""
    """Local .safetensors weights of the home-made vision tower; empty: deterministic random init
    (unused for a LLaVA model)."""
    seed: int = 0
    """Seed of the random init (the same seed gives the same tower in every process)."""
    image_size: int = 224
    """Side of the square every image is resized to (home-made tower; a LLaVA model's processor
    config decides its own)."""
    patch_size: int = 16
    """Side of one patch: each patch is one embedding row, one placeholder token (home-made tower)."""
    device: str = "auto"
    """"cpu", "cuda" or "auto"."""
    max_images_per_request: int = 8
    """Most images in one request."""
    max_image_bytes: int = 20 * 1024 * 1024
    """Largest decoded image accepted (the router's body limit also bounds it)."""
    max_image_pixels: int = 36_000_000
    """Largest width x height accepted: a small compressed file can claim a huge canvas."""
    port: int = 50051
    """gRPC port; 0 picks a free one."""
    cache_mib: int = 256
    """Registered memory for embedding rows: those lent to prefill instances (read one-sided)
    and, LRU, the embedding cache (a hit skips the tower); 0: every image's rows travel inline
    in the Encode reply and nothing is cached."""
    lease_ttl_s: float = 60.0
    """How long lent rows stay pinned for a reader that has not released them."""
    inline_max_bytes: int = 0
    """Rows of at most this many bytes travel inline in the Encode reply instead (0: none)."""
    transfer_port: int = 0
    """TCP port of the data server prefill instances on other hosts read rows from; 0: a free one."""
    kv_transport: str = "auto"
    """How peers read the rows: auto (shared memory on one host, TCP across hosts), shm or tcp."""
    advertise_host: str = ""
    """Host name peers use to reach this instance's data server; empty: the bind host."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.cache_mib >= 0, "cache_mib", "must be >= 0 (0: no cache, rows inline)")
        check(self.lease_ttl_s > 0, "lease_ttl_s", "must be > 0")
        check(self.inline_max_bytes >= 0, "inline_max_bytes", "must be >= 0")
        check(0 <= self.transfer_port <= 65535, "transfer_port", "must be in 0..65535 (0: a free port)")
        check(self.kv_transport in ("auto", "shm", "tcp"), "kv_transport", "must be one of auto, shm, tcp")
        check(self.image_size > 0 and self.patch_size > 0 and self.image_size % self.patch_size == 0,
              "image_size", "must be a positive multiple of patch_size")
        check(self.max_images_per_request > 0, "max_images_per_request", "must be > 0")
        check(self.max_image_bytes > 0, "max_image_bytes", "must be > 0")
        check(self.max_image_pixels > 0, "max_image_pixels", "must be > 0")
