"""Prefill service settings: every field a --flag and an EPD_PREFILL_* variable."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import check
from services.engine.serving.instance import ServingConfig


@dataclass(frozen=True)
class PrefillConfig(ServingConfig):
    """A prefill instance: computes prompts' KV and first tokens, then lends the KV to decode."""

    port: int = 50061
    """gRPC port; 0 picks a free one."""
    lease_ttl_s: float = 30.0
    """How long exported KV is held for a decode instance that has not released it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.lease_ttl_s > 0, "lease_ttl_s", "must be > 0")
