"""Router settings: every field a --flag and an EPD_ROUTER_* variable."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import check


@dataclass(frozen=True)
class RouterConfig:
    """The HTTP front door: OpenAI API in, prefill and decode instances over gRPC behind it."""

    host: str = "127.0.0.1"
    """Address the HTTP server binds to; 0.0.0.0 in a container."""
    port: int = 8000
    """HTTP port (the OpenAI API, /health, /metrics); 0 picks a free one."""
    prefill: tuple[str, ...] = ("127.0.0.1:50061",)
    """gRPC addresses of the prefill instances (comma-separated or repeated)."""
    decode: tuple[str, ...] = ("127.0.0.1:50071",)
    """gRPC addresses of the decode instances."""
    encoder: tuple[str, ...] = ()
    """gRPC addresses of the encoder instances; none: images are refused."""
    served_model_name: tuple[str, ...] = ()
    """Extra names clients may use for the model (its own name always works)."""
    connect_timeout_s: float = 120.0
    """How long to wait at start for a prefill instance to describe the model."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long open requests get to finish."""

    def __post_init__(self) -> None:
        check(0 <= self.port <= 65535, "port", "must be in 0..65535 (0: a free port)")
        check(bool(self.prefill), "prefill", "needs at least one prefill address")
        check(bool(self.decode), "decode", "needs at least one decode address")
        check(self.connect_timeout_s > 0, "connect_timeout_s", "must be > 0")
