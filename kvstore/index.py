"""Which blocks a store holds, for how long, and which go first when it is full.

The metadata index sits behind one small interface (STYLE rule 5): :class:`EmbeddedIndex` lives
inside a store process and makes every decision; ``redis_index.RedisIndex`` implements the same
methods in a shared Redis, where ``mirrored_index.MirroredIndex`` publishes a node's embedded
index for its peers to read. Every decision takes the time from an injectable clock,
so tests and the trace replay move time instead of waiting for it.

A block is in one of three states::

    live      now < expires_at                 hits renew expires_at = now + its TTL
    expired   now >= expires_at                never a hit; evicted before any live block
    gone      evicted or removed

Eviction when an insert finds the index full: the expired block that expired first, else the
least recently used live block (a hit or an insert counts as a use). Expiry is tracked in a
heap with lazy deletion, so both choices cost O(log n).
"""

from __future__ import annotations

import heapq
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

Clock = Callable[[], float]

DEFAULT_CAPACITY_BLOCKS = 65_536
"""Blocks a store node's host tier holds by default: 8 GiB of the reference's ~128 KiB blocks."""


@dataclass
class Entry:
    expires_at: float
    ttl_s: float
    """Each hit moves ``expires_at`` to now + ttl_s."""


class BlockIndex(ABC):
    def lookup(self, hashes: Sequence[Hashable]) -> int:
        """How many leading ``hashes`` are live here; renews each of them (their TTL and LRU).
        (Indexes override this with one pass; here it is defined by :meth:`present`.)"""
        num_hits = 0
        for block_hash in hashes:
            if not self.present([block_hash])[0]:
                break
            num_hits += 1
        return num_hits

    @abstractmethod
    def present(self, hashes: Sequence[Hashable]) -> list[bool]:
        """Which of ``hashes`` are live here (each on its own, not just a prefix); renews those."""

    @abstractmethod
    def insert(self, block_hash: Hashable, ttl_s: float, expires_at: float | None = None) -> list[Hashable]:
        """Record a block (or renew it) until ``expires_at`` (default: now + ttl_s); returns the
        blocks evicted to make room."""

    @abstractmethod
    def remove(self, block_hash: Hashable) -> bool:
        """Forget a block (its data failed a checksum, say); False if it was not there."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every block (a node whose memory is new starts empty)."""

    @abstractmethod
    def __len__(self) -> int:
        """Blocks held, expired ones included until they are evicted."""


class EmbeddedIndex(BlockIndex):
    def __init__(self, capacity_blocks: int, clock: Clock = time.time) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1 (got {capacity_blocks})")
        self.capacity_blocks = capacity_blocks
        self.clock = clock
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()  # LRU first
        self._expiry: list[tuple[float, int, Hashable]] = []  # (expires_at, seq, hash), lazily pruned
        self._seq = 0
        self.num_evicted_expired = 0
        self.num_evicted_lru = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, hashes: Sequence[Hashable]) -> int:
        now = self.clock()
        num_hits = 0
        for block_hash in hashes:
            entry = self._entries.get(block_hash)
            if entry is None or entry.expires_at <= now:
                break
            self._renew(block_hash, entry, now)
            num_hits += 1
        return num_hits

    def present(self, hashes: Sequence[Hashable]) -> list[bool]:
        now = self.clock()
        found = []
        for block_hash in hashes:
            entry = self._entries.get(block_hash)
            is_live = entry is not None and entry.expires_at > now
            if is_live:
                self._renew(block_hash, entry, now)
            found.append(is_live)
        return found

    def insert(self, block_hash: Hashable, ttl_s: float, expires_at: float | None = None) -> list[Hashable]:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 (got {ttl_s!r})")
        now = self.clock()
        entry = self._entries.get(block_hash)
        if entry is not None:
            entry.ttl_s = max(entry.ttl_s, ttl_s)  # the longer-lived class wins
            self._renew(block_hash, entry, now)
            return []
        evicted = []
        while len(self._entries) >= self.capacity_blocks:
            evicted.append(self._evict_one(now))
        entry = Entry(now + ttl_s if expires_at is None else expires_at, ttl_s)
        self._entries[block_hash] = entry
        self._push_expiry(block_hash, entry)
        return evicted

    def remove(self, block_hash: Hashable) -> bool:
        return self._entries.pop(block_hash, None) is not None

    def clear(self) -> None:
        self._entries.clear()
        self._expiry.clear()

    def items(self) -> list[tuple[Hashable, Entry]]:
        """Every block held (expired ones too), least recently used first."""
        return list(self._entries.items())

    def is_live(self, block_hash: Hashable) -> bool:
        entry = self._entries.get(block_hash)
        return entry is not None and entry.expires_at > self.clock()

    def entry(self, block_hash: Hashable) -> Entry | None:
        """The block's record as it stands (no renewal); None: not held."""
        return self._entries.get(block_hash)

    # ----- internals ---------------------------------------------------------------------
    def _renew(self, block_hash: Hashable, entry: Entry, now: float) -> None:
        entry.expires_at = now + entry.ttl_s
        self._entries.move_to_end(block_hash)
        self._push_expiry(block_hash, entry)

    def _push_expiry(self, block_hash: Hashable, entry: Entry) -> None:
        self._seq += 1
        heapq.heappush(self._expiry, (entry.expires_at, self._seq, block_hash))
        if len(self._expiry) > 4 * len(self._entries) + 64:
            self._compact_expiry()

    def _compact_expiry(self) -> None:
        """Drop heap items that no longer match their entry (renewed or gone)."""
        self._expiry = [item for item in self._expiry
                        if (e := self._entries.get(item[2])) is not None and e.expires_at == item[0]]
        heapq.heapify(self._expiry)

    def _evict_one(self, now: float) -> Hashable:
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, _, block_hash = heapq.heappop(self._expiry)
            entry = self._entries.get(block_hash)
            if entry is not None and entry.expires_at == expires_at:  # not renewed since
                del self._entries[block_hash]
                self.num_evicted_expired += 1
                return block_hash
        block_hash, _ = self._entries.popitem(last=False)
        self.num_evicted_lru += 1
        return block_hash
