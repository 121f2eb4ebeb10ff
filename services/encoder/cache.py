"""The encoder's embedding cache: image hash -> embedding rows, in the registered memory that
prefill instances read them from.

One buffer serves both jobs, so a hit is lent without a copy and the cache's bound is the
region's size::

    region (registered with the transfer engine, readable one-sided by prefill)
    +---------+---------+---------+---------+-----+
    | chunk 0 | chunk 1 | chunk 2 | chunk 3 | ... |   chunk c: bytes [c * chunk_bytes, +chunk_bytes)
    +---------+---------+---------+---------+-----+
      image A (2 chunks, pinned by a lease)   image B (1 chunk, unpinned: evictable)

An entry's chunks need not be adjacent (the handle names each one), so freeing never leaves a
hole too small to use. Entries are kept most recently used last; making room evicts from the
front, skipping pinned ones (rows a prefill may be reading). No room even then is ``None``: the
caller sends those rows inline. Thread-safe: the encoder thread looks entries up while the
event loop lends and releases them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from services.common import metrics

CACHE_LOOKUPS = metrics.counter("epd_encoder_cache_total", "Encoder embedding-cache lookups by result (hit: "
                                "the tower's forward pass was skipped; miss).", ["result"])
CACHE_BYTES = metrics.gauge("epd_encoder_cache_bytes", "Bytes of embedding rows the encoder holds (cached or lent).")


@dataclass(eq=False)
class Entry:
    """One image's rows: ``num_bytes`` over ``chunks`` in order; lent while ``num_pins`` > 0."""

    key: bytes
    chunks: list[int]
    num_bytes: int
    shape: tuple[int, ...]
    dtype: str
    num_pins: int = 0
    is_cached: bool = field(default=True)
    """False once evicted or replaced (its chunks go back when the last pin does)."""


class EmbeddingCache:
    def __init__(self, buffer: np.ndarray, chunk_bytes: int = 64 << 10) -> None:
        """``buffer``: the uint8 memory the rows live in (a registered region's)."""
        assert buffer.dtype == np.uint8 and buffer.ndim == 1, "a flat uint8 buffer"
        assert chunk_bytes > 0 and len(buffer) >= chunk_bytes, (chunk_bytes, len(buffer))
        self.buffer = buffer
        self.chunk_bytes = chunk_bytes
        self.num_chunks = len(buffer) // chunk_bytes
        self._free = list(range(self.num_chunks - 1, -1, -1))  # popped from the end: chunk 0 first
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes

    @property
    def num_used_bytes(self) -> int:
        return (self.num_chunks - len(self._free)) * self.chunk_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def acquire(self, key: bytes) -> Entry | None:
        """The cached entry, pinned (most recently used now), counted as a hit; None: a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                entry.num_pins += 1
        CACHE_LOOKUPS.labels("hit" if entry is not None else "miss").inc()
        return entry

    def put(self, key: bytes, data: np.ndarray, shape: tuple[int, ...], dtype: str) -> Entry | None:
        """Copy ``data`` (uint8 bytes of the rows) in and cache it, pinned once; None when no room
        is left even after evicting every unpinned entry (nothing changes then)."""
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        num_chunks = max(1, -(-len(data) // self.chunk_bytes))
        with self._lock:
            if not self._make_room(num_chunks):
                return None
            chunks = [self._free.pop() for _ in range(num_chunks)]
            entry = Entry(key, chunks, len(data), tuple(shape), dtype, num_pins=1)
            old = self._entries.pop(key, None)
            if old is not None:  # the same image encoded twice at once: the newer one stays
                self._drop(old)
            self._entries[key] = entry
        for i, chunk in enumerate(chunks):
            piece = data[i * self.chunk_bytes:(i + 1) * self.chunk_bytes]
            start = chunk * self.chunk_bytes
            self.buffer[start:start + len(piece)] = piece
        CACHE_BYTES.set(self.num_used_bytes)
        return entry

    def unpin(self, entry: Entry) -> None:
        with self._lock:
            assert entry.num_pins > 0, "unpinned more often than pinned"
            entry.num_pins -= 1
            if entry.num_pins == 0 and not entry.is_cached:
                self._free.extend(entry.chunks)
        CACHE_BYTES.set(self.num_used_bytes)

    def ranges(self, entry: Entry) -> list[tuple[int, int]]:
        """(offset, length) in the buffer of each piece of the rows, in order."""
        sizes = [self.chunk_bytes] * (len(entry.chunks) - 1)
        sizes.append(entry.num_bytes - self.chunk_bytes * (len(entry.chunks) - 1))
        return [(chunk * self.chunk_bytes, size) for chunk, size in zip(entry.chunks, sizes) if size > 0]

    def read(self, entry: Entry) -> bytes:
        """The rows' bytes (a copy)."""
        return b"".join(self.buffer[o:o + n].tobytes() for o, n in self.ranges(entry))

    def _make_room(self, num_chunks: int) -> bool:
        """Evict unpinned entries, least recently used first, until ``num_chunks`` are free."""
        if num_chunks > self.num_chunks:
            return False
        if len(self._free) >= num_chunks:
            return True
        evictable = [e for e in self._entries.values() if e.num_pins == 0]
        if len(self._free) + sum(len(e.chunks) for e in evictable) < num_chunks:
            return False
        for entry in evictable:
            del self._entries[entry.key]
            self._drop(entry)
            if len(self._free) >= num_chunks:
                break
        return True

    def _drop(self, entry: Entry) -> None:
        entry.is_cached = False
        if entry.num_pins == 0:
            self._free.extend(entry.chunks)
