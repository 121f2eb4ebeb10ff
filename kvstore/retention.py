"""How long stored block KV lives: a TTL per request class, renewed on every hit.

The reference keeps agent traffic 3 days and chat 7 days (cutting 7 to 3 days lost only
0.5-1% of hits). A request names its class through the API; otherwise its tenant's default,
otherwise the protocol's (chat endpoints: chat).
"""

from __future__ import annotations

from dataclasses import dataclass

DAY_S = 86_400.0


@dataclass(frozen=True)
class Retention:
    agent_ttl_s: float = 3 * DAY_S
    """Block TTL for agent traffic."""
    chat_ttl_s: float = 7 * DAY_S
    """Block TTL for chat traffic."""

    def __post_init__(self) -> None:
        for name in ("agent_ttl_s", "chat_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)!r})")

    def ttl_s(self, request_class: str) -> float:
        if request_class == "agent":
            return self.agent_ttl_s
        if request_class == "chat":
            return self.chat_ttl_s
        raise ValueError(f"unknown request class {request_class!r} (agent or chat)")
