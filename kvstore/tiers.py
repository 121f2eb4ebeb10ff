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
    def __init__(self, block_bytes: int, capacity_blocks: int, clock: Clock = time.time,
                 shm: bool = True, region_id: str | None = None) -> None:
        self.block_bytes = block_bytes
        self.index = EmbeddedIndex(capacity_blocks, clock)
        self.region = MemoryRegion.allocate(block_bytes * capacity_blocks, region_id=region_id, shm=shm)
        self._slots: dict[Hashable, int] = {}
        self._free = list(range(capacity_blocks - 1, -1, -1))

    def lookup(self, hashes: Sequence[Hashable]) -> int:
        return self.index.lookup(hashes)

    def put(self, block_hash: Hashable, data, ttl_s: float) -> int:
        """Store (or renew) a block; returns its slot. Evicted blocks give their slots back."""
        if len(memoryview(data).cast("B")) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, not {len(memoryview(data).cast('B'))}")
        for gone in self.index.insert(block_hash, ttl_s):
            self._free.append(self._slots.pop(gone))
        slot = self._slots.get(block_hash)
        if slot is None:
            slot = self._slots[block_hash] = self._free.pop()
            self.block(slot)[:] = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        return slot

    def get(self, block_hash: Hashable) -> np.ndarray | None:
        """The live block's bytes (a view into the pool), or None."""
        if not self.index.is_live(block_hash):
            return None
        return self.block(self._slots[block_hash])

    def slot_of(self, block_hash: Hashable) -> int | None:
        return self._slots.get(block_hash) if self.index.is_live(block_hash) else None

    def block(self, slot: int) -> np.ndarray:
        return self.region.buffer[slot * self.block_bytes:(slot + 1) * self.block_bytes]

    def close(self) -> None:
        self.region.close()


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
