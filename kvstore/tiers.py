"""The store node's two tiers of block KV: host memory and local disk.

Both hold fixed-size blocks named by their chained hash and delegate *which* blocks stay to an
:class:`~kvstore.index.EmbeddedIndex` (TTL renewed on hit, expired first then LRU).

* :class:`HostTier`: a pre-allocated, pre-touched pool of block slots in one registered memory
  region, so engines read and write blocks one-sided through the transfer engine.
* :class:`DiskTier`: append-only segment files, one record per block, each with its own
  checksum. Writes go through a background thread, off the request's critical path. A node
  that restarts rebuilds its index from the segments; a record that fails its checksum on read
  is dropped and reported as a miss (the block is recomputed, never served wrong).

Segment record::

    | magic "EPDB" | hash (32) | length u32 | checksum u64 | expires_at f64 | ttl_s f64 | data |

A segment file is deleted once every record in it is dead (evicted, expired or superseded).
"""

from __future__ import annotations

import os
import queue
import struct
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.index import Clock, EmbeddedIndex
from kvstore.transfer.checksum import checksum
from kvstore.transfer.memory import MemoryRegion

_RECORD = struct.Struct("<4s32sIQdd")
_MAGIC = b"EPDB"
_SEGMENT_PREFIX = "segment-"


class HostTier:
    """Block slots in one registered region: ``capacity_blocks`` for stored blocks plus
    ``num_staging_slots`` that incoming blocks land in before they are committed (so a block
    being written is never visible, and a full tier still accepts writes)::

        take_slot() --> read data into block(slot) --> commit(hash, slot) | abandon(slot)

    A pinned slot (lent to a reader) is never reused: evicting its block frees the slot only
    when the last pin goes.
    """

    def __init__(self, block_bytes: int, capacity_blocks: int, clock: Clock = time.time,
                 shm: bool = True, region_id: str | None = None, num_staging_slots: int = 64) -> None:
        self.block_bytes = block_bytes
        self.capacity_blocks = capacity_blocks
        self.index = EmbeddedIndex(capacity_blocks, clock)
        num_slots = capacity_blocks + num_staging_slots
        self.region = MemoryRegion.allocate(block_bytes * num_slots, region_id=region_id, shm=shm)
        self._slots: dict[Hashable, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins: dict[int, int] = {}
        self._evicted_pinned: set[int] = set()

    def __len__(self) -> int:
        return len(self._slots)

    def lookup(self, hashes: Sequence[Hashable]) -> int:
        return self.index.lookup(hashes)

    def take_slot(self) -> int | None:
        """A free slot for an incoming block; None: every spare slot is busy."""
        return self._free.pop() if self._free else None

    def abandon(self, slot: int) -> None:
        self._free.append(slot)

    def commit(self, block_hash: Hashable, slot: int, ttl_s: float) -> int:
        """The slot now holds the block: index it (evicting as needed). Returns its slot; when
        the block was already here the new slot goes back and the old one is returned."""
        for gone in self.index.insert(block_hash, ttl_s):
            self._release_slot(self._slots.pop(gone))
        old = self._slots.get(block_hash)
        if old is not None:
            self._free.append(slot)
            return old
        self._slots[block_hash] = slot
        return slot

    def put(self, block_hash: Hashable, data, ttl_s: float) -> int | None:
        """Store (or renew) a block from bytes; its slot, or None when no slot is spare."""
        view = memoryview(data).cast("B")
        if len(view) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, not {len(view)}")
        if self.slot_of(block_hash) is not None:
            return self.commit(block_hash, self._slots[block_hash], ttl_s)
        slot = self.take_slot()
        if slot is None:
            return None
        self.block(slot)[:] = np.frombuffer(view, dtype=np.uint8)
        return self.commit(block_hash, slot, ttl_s)

    def remove(self, block_hash: Hashable) -> bool:
        if not self.index.remove(block_hash):
            return False
        self._release_slot(self._slots.pop(block_hash))
        return True

    def get(self, block_hash: Hashable) -> np.ndarray | None:
        """The live block's bytes (a view into the pool), or None."""
        slot = self.slot_of(block_hash)
        return None if slot is None else self.block(slot)

    def slot_of(self, block_hash: Hashable) -> int | None:
        return self._slots.get(block_hash) if self.index.is_live(block_hash) else None

    def block(self, slot: int) -> np.ndarray:
        return self.region.buffer[slot * self.block_bytes:(slot + 1) * self.block_bytes]

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            del self._pins[slot]
            if slot in self._evicted_pinned:
                self._evicted_pinned.discard(slot)
                self._free.append(slot)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def close(self) -> None:
        self.region.close()

    def _release_slot(self, slot: int) -> None:
        if slot in self._pins:
            self._evicted_pinned.add(slot)
        else:
            self._free.append(slot)


@dataclass
class _Location:
    segment: int
    offset: int  # of the record's data


class DiskTier:
    def __init__(self, directory: str | os.PathLike, block_bytes: int, capacity_blocks: int,
                 clock: Clock = time.time, segment_bytes: int = 64 << 20) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self.clock = clock
        self.index = EmbeddedIndex(capacity_blocks, clock)
        self.records_per_segment = max(1, segment_bytes // (_RECORD.size + block_bytes))
        self.num_corrupt = 0
        self._where: dict[Hashable, _Location] = {}
        self._live: dict[int, int] = {}  # segment -> live records
        self._lock = threading.Lock()  # guards _where, _live and the index against the writer
        self._segment, self._num_in_segment = -1, 0
        self._segment = self._rebuild()
        self._writes: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="epd-disk-tier", daemon=True)
        self._writer.start()

    # ----- the request path ------------------------------------------------------------------
    def lookup(self, hashes: Sequence[Hashable]) -> int:
        with self._lock:
            return self.index.lookup(hashes)

    def put(self, block_hash: Hashable, data, ttl_s: float) -> None:
        """Queue a block for writing (returns at once; :meth:`flush` waits for the disk)."""
        payload = bytes(memoryview(data).cast("B"))
        if len(payload) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, not {len(payload)}")
        self._writes.put((block_hash, payload, ttl_s))

    def get(self, block_hash: Hashable) -> bytes | None:
        """The block's bytes if it is live and intact; a corrupt record is dropped (a miss)."""
        with self._lock:
            location = self._where.get(block_hash) if self.index.is_live(block_hash) else None
        if location is None:
            return None
        with open(self._path(location.segment), "rb") as f:
            f.seek(location.offset - _RECORD.size)
            header = f.read(_RECORD.size)
            data = f.read(self.block_bytes)
        if (len(header) == _RECORD.size and len(data) == self.block_bytes
                and _RECORD.unpack(header)[3] == checksum(data)):
            return data
        self.num_corrupt += 1
        with self._lock:
            if self.index.remove(block_hash):
                self._forget(block_hash)
        return None

    def remove(self, block_hash: Hashable) -> bool:
        """Forget a block (its record becomes dead); False if it was not here."""
        with self._lock:
            if not self.index.remove(block_hash):
                return False
            self._forget(block_hash)
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self.index)

    def entries(self) -> list[tuple[Hashable, float, float]]:
        """(hash, expires_at, ttl_s) of every block held, e.g. to rebuild another index."""
        with self._lock:
            return [(h, e.expires_at, e.ttl_s) for h, e in self.index.items()]

    def flush(self) -> None:
        self._writes.join()

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join()

    # ----- the writer thread -------------------------------------------------------------------
    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            try:
                self._write(*item)
            finally:
                self._writes.task_done()
        self._writes.task_done()

    def _write(self, block_hash: Hashable, payload: bytes, ttl_s: float) -> None:
        with self._lock:
            if self.index.is_live(block_hash):
                self.index.insert(block_hash, ttl_s)  # already on disk: renew only
                return
        if self._num_in_segment >= self.records_per_segment:
            self._segment, self._num_in_segment = self._segment + 1, 0
        expires_at = self.clock() + ttl_s
        header = _RECORD.pack(_MAGIC, _hash_bytes(block_hash), len(payload), checksum(payload), expires_at, ttl_s)
        path = self._path(self._segment)
        with open(path, "ab") as f:
            offset = f.tell() + _RECORD.size
            f.write(header + payload)
        self._num_in_segment += 1
        with self._lock:
            self._add(block_hash, _Location(self._segment, offset), ttl_s)

    # ----- bookkeeping -------------------------------------------------------------------------
    def _add(self, block_hash: Hashable, location: _Location, ttl_s: float,
             expires_at: float | None = None, is_rebuilding: bool = False) -> None:
        if block_hash in self._where:  # superseded by a newer record
            self._forget(block_hash, is_rebuilding)
            self.index.remove(block_hash)
        for gone in self.index.insert(block_hash, ttl_s, expires_at):
            self._forget(gone, is_rebuilding)
        self._where[block_hash] = location
        self._live[location.segment] = self._live.get(location.segment, 0) + 1

    def _forget(self, block_hash: Hashable, is_rebuilding: bool = False) -> None:
        location = self._where.pop(block_hash)
        self._live[location.segment] -= 1
        # While rebuilding, segments are still being read: dead ones go once all are read.
        if self._live[location.segment] == 0 and location.segment != self._segment and not is_rebuilding:
            del self._live[location.segment]
            self._path(location.segment).unlink(missing_ok=True)

    def _rebuild(self) -> int:
        """Index every intact, unexpired record of the segments; the next segment number."""
        segments = sorted(int(p.name.removeprefix(_SEGMENT_PREFIX)) for p in self.directory.glob(f"{_SEGMENT_PREFIX}*"))
        now = self.clock()
        for segment in segments:
            for block_hash, offset, expires_at, ttl_s in self._scan(segment):
                if expires_at > now:  # (a hit's renewal is not persisted: the write's expiry counts)
                    self._add(block_hash, _Location(segment, offset), ttl_s, expires_at, is_rebuilding=True)
        for segment in segments:
            if not self._live.get(segment):
                self._live.pop(segment, None)
                self._path(segment).unlink(missing_ok=True)
        return (segments[-1] + 1) if segments else 0

    def _scan(self, segment: int):
        with open(self._path(segment), "rb") as f:
            while len(header := f.read(_RECORD.size)) == _RECORD.size:
                magic, digest, length, _, expires_at, ttl_s = _RECORD.unpack(header)
                if magic != _MAGIC or length != self.block_bytes:
                    return  # a torn or foreign tail: stop here
                offset = f.tell()
                if len(f.read(length)) != length:
                    return
                yield digest, offset, expires_at, ttl_s

    def _path(self, segment: int) -> Path:
        return self.directory / f"{_SEGMENT_PREFIX}{segment:08d}"


def _hash_bytes(block_hash: Hashable) -> bytes:
    if not isinstance(block_hash, bytes) or len(block_hash) != 32:
        raise ValueError("disk records need 32-byte block hashes (kvstore.hashing)")
    return block_hash
