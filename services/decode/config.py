"""Decode service settings: every field a --flag and an EPD_DECODE_* variable."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import check
from services.engine.serving.instance import ServingConfig

KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class DecodeConfig(ServingConfig):
    """A decode instance: pulls prompts' KV from prefill instances and generates the rest."""

    port: int = 50071
    """gRPC port; 0 picks a free one."""
    kv_load_failure_policy: str = "recompute"
    """When the prompt's KV cannot be read from its prefill instance (gone, corrupted, layout
    mismatch): recompute it here (same tokens, slower), or fail the request (vLLM's names)."""
    heartbeat_s: float = 1.0
    """A token stream that has nothing to send for this long sends an empty chunk, so the router
    tells a busy instance (a long recompute) from a frozen one (its idle deadline is longer)."""

    def __post_init__(self) -> None:
        ServingConfig.__post_init__(self)
        check(self.kv_load_failure_policy in KV_LOAD_FAILURE_POLICIES, "kv_load_failure_policy",
              f"must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}")
        check(self.heartbeat_s > 0, "heartbeat_s", "must be > 0")
