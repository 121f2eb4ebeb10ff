"""A store node's block index: its own, and published in a shared Redis for the other nodes.

The node decides with its :class:`~kvstore.index.EmbeddedIndex` alone (TTLs, hits, eviction), so
Redis being down never stops it serving its own blocks. Every change (insert, renewal on a hit,
eviction, removal) is noted, and :meth:`MirroredIndex.flush` writes the noted changes to the
mirror (a :class:`~kvstore.redis_index.RedisIndex` under the node's prefix) that the other
nodes read. While the mirror is in doubt (never written, a flush failed, Redis lost it) changes
are not noted: the next flush re-publishes the whole index instead::

    insert / hit / evict / remove ──note──► pending ──flush()──► mirror.publish(pending)
                                                        fails ──► needs_resync
    clear() / needs_resync / Redis lost it ──flush()──► mirror.replace_all(every block)

Lookups of the node's own blocks never touch Redis; who calls flush (and how often, and with
what back-off while Redis is down) is the service's business (``services/kvstore``).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping, Sequence
from typing import Protocol

from kvstore.index import BlockIndex, EmbeddedIndex, Entry

State = tuple[float, float] | None
"""A block as published: (expires_at, ttl_s), or None: gone."""


class Mirror(Protocol):
    """Where the index is published (a RedisIndex; a fake in tests). Each method may raise."""

    def publish(self, changes: Mapping[Hashable, State]) -> None: ...
    def replace_all(self, entries: Mapping[Hashable, tuple[float, float]]) -> None: ...
    def is_published(self) -> bool: ...


class MirroredIndex(BlockIndex):
    def __init__(self, local: EmbeddedIndex, mirror: Mirror) -> None:
        self.local = local
        self.mirror = mirror
        self._lock = threading.Lock()  # the local index and the pending changes
        self._flush_lock = threading.Lock()  # one flush at a time: the mirror gets changes in order
        self._pending: dict[Hashable, State] = {}
        self.needs_resync = True
        """What the mirror holds is unknown (nothing published yet, or a flush failed)."""
        self.num_resyncs = 0

    # ----- BlockIndex: the local index decides -------------------------------------------------
    def lookup(self, hashes: Sequence[Hashable]) -> int:
        with self._lock:
            num_hits = self.local.lookup(hashes)
            self._note_live(hashes[:num_hits])
            return num_hits

    def present(self, hashes: Sequence[Hashable]) -> list[bool]:
        with self._lock:
            found = self.local.present(hashes)
            self._note_live([h for h, is_held in zip(hashes, found) if is_held])
            return found

    def insert(self, block_hash: Hashable, ttl_s: float, expires_at: float | None = None) -> list[Hashable]:
        with self._lock:
            evicted = self.local.insert(block_hash, ttl_s, expires_at)
            for gone in evicted:
                self._note(gone, None)
            self._note_live([block_hash])
            return evicted

    def remove(self, block_hash: Hashable) -> bool:
        with self._lock:
            is_removed = self.local.remove(block_hash)
            if is_removed:
                self._note(block_hash, None)
            return is_removed

    def clear(self) -> None:
        with self._lock:
            self.local.clear()
            self._doubt()

    def __len__(self) -> int:
        return len(self.local)

    def is_live(self, block_hash: Hashable) -> bool:
        with self._lock:
            return self.local.is_live(block_hash)

    def items(self) -> list[tuple[Hashable, Entry]]:
        with self._lock:
            return self.local.items()

    # ----- the mirror ----------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.needs_resync or bool(self._pending)

    def flush(self) -> None:
        """Publish what changed since the last flush (everything, when in doubt); raises the
        mirror's error, after which the next flush publishes everything."""
        with self._flush_lock:
            with self._lock:
                is_resync = self.needs_resync
                if is_resync:
                    batch = {h: (e.expires_at, e.ttl_s) for h, e in self.local.items()}
                else:
                    batch = self._pending
                self._pending, self.needs_resync = {}, False
            if not batch and not is_resync:
                return
            try:
                if is_resync:
                    self.mirror.replace_all(batch)
                    self.num_resyncs += 1
                else:
                    self.mirror.publish(batch)
            except BaseException:
                with self._lock:
                    self._doubt()
                raise

    def check_published(self) -> None:
        """If Redis lost the mirror (restarted empty, flushed), the next flush publishes it all."""
        with self._flush_lock:
            if not self.mirror.is_published():
                with self._lock:
                    self._doubt()

    # ----- internals -----------------------------------------------------------------------------
    def _doubt(self) -> None:
        self._pending, self.needs_resync = {}, True

    def _note(self, block_hash: Hashable, state: State) -> None:
        if not self.needs_resync:  # a resync will publish the block as it then stands
            self._pending[block_hash] = state

    def _note_live(self, hashes: Sequence[Hashable]) -> None:
        if self.needs_resync:
            return
        for block_hash in hashes:
            entry = self.local.entry(block_hash)
            self._pending[block_hash] = (entry.expires_at, entry.ttl_s)
