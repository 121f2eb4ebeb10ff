"""Decode service settings: every field a --flag and an EPD_DECODE_* variable."""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.serving import ServingConfig


@dataclass(frozen=True)
class DecodeConfig(ServingConfig):
    """A decode instance: pulls prompts' KV from prefill instances and generates the rest."""

    port: int = 50071
    """gRPC port; 0 picks a free one."""
