"""The SWA tier: sliding-window KV in host memory, one copy, short-lived (180 s by default).

Models with sliding-window layers need, besides the block KV of a prefix, the window of KV
that ends where the prefix ends. That window is keyed by (sequence hash, window end): the hash
of the prefix's last full block names everything before it, and the end position says where
the window stops. Entries expire quickly (the reference hits >= 98% with 180 s) and are evicted
expired first, then least recently used, by the same index code as block KV.

What an entry holds is its owner's: an engine instance keeps the window's KV in slots of its
SWA region (services/engine/serving/swa_tier.py) and hands back the slots of what was evicted;
a store node keeps the descriptor an instance published (where to read the window one-sided).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Generic, TypeVar

from kvstore.index import Clock, EmbeddedIndex

DEFAULT_SWA_TTL_S = 180.0

V = TypeVar("V")


class SWAPool(Generic[V]):
    def __init__(self, capacity_entries: int, ttl_s: float = DEFAULT_SWA_TTL_S, clock: Clock = time.time) -> None:
        self.ttl_s = ttl_s
        self.index = EmbeddedIndex(capacity_entries, clock)
        self._data: dict[tuple[Hashable, int], V] = {}

    def put(self, sequence_hash: Hashable, window_end: int, value: V) -> list[V]:
        """Keep ``value`` for the window (replacing what it held); the values it evicted or replaced."""
        key = (sequence_hash, window_end)
        gone = [self._data.pop(k) for k in self.index.insert(key, self.ttl_s)]
        if key in self._data:
            gone.append(self._data[key])
        self._data[key] = value
        return gone

    def lookup(self, sequence_hash: Hashable, window_end: int) -> bool:
        """Whether the window is here (a hit renews it)."""
        return self.index.lookup([(sequence_hash, window_end)]) == 1

    def get(self, sequence_hash: Hashable, window_end: int) -> V | None:
        return self._data[(sequence_hash, window_end)] if self.lookup(sequence_hash, window_end) else None

    def __len__(self) -> int:
        return len(self.index)
