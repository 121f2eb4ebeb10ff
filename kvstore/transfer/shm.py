"""Same-host transport: map the owner's /dev/shm region file and copy blocks straight out.

One copy per block (owner's pages -> destination pool), no owner involvement, no syscalls per
block. A read's blocks are split across a few copy threads, each copying a block piece by piece
and checksumming each piece while it is still in L2. numpy, not torch: its copies release the GIL, and
torch's per-thread OpenMP teams spinning against each other (and against the engine's own
forward pass) cost more than they gained in measurements.

Mappings are cached per region file; a file that disappears (owner closed the region or died)
or is replaced drops its cached mapping, so an old region's memory is not pinned.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvstore.transfer.base import (
    Transport, TransportOptions, TransferError, check_destinations, mismatch, start_read)
from kvstore.transfer.checksum import CHUNK_BYTES, chunk_sums, combine
from kvstore.transfer.descriptors import KVHandle, RegionDesc, RegionId
from kvstore.transfer.memory import SHM_PREFIX, MemoryRegion
from kvstore.transfer.state import TransferOp

MAX_CACHED_MAPPINGS = 64
PIECE_BYTES = 256 << 10
"""Copied and summed at a time: a piece stays in the core's L2 (512 KiB here) between its copy
and its sum; a whole 720 KiB SmolLM2 block would be summed from L3."""
assert PIECE_BYTES % CHUNK_BYTES == 0, "pieces must start on checksum chunk boundaries"
SWEEP_INTERVAL_S = 1.0


@dataclass(frozen=True)
class _Mapping:
    inode: int
    data: np.ndarray
    """Read-only uint8 over the whole file; keeps the mmap alive until the last reference goes."""


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, options: TransportOptions):
        self._options = options
        self._executor = ThreadPoolExecutor(options.num_workers, thread_name_prefix="epd-shm")
        self._num_copy_threads = options.num_copy_threads or min(4, os.cpu_count() or 1)
        self._copiers = ThreadPoolExecutor(self._num_copy_threads, thread_name_prefix="epd-shm-copy")
        self._mappings: dict[str, _Mapping] = {}
        self._lock = threading.Lock()
        self._last_sweep = time.monotonic()

    def register(self, region: MemoryRegion) -> None:
        pass  # the region file itself is the export; peers need nothing from us

    def unregister(self, region_id: RegionId) -> None:
        pass

    def can_read(self, handle: KVHandle) -> bool:
        if handle.owner.host_id != self._options.host_id:
            return False
        needed = {block.region_id for block in handle.blocks}
        descs = [handle.region(region_id) for region_id in needed]
        return all(d is not None and d.shm_path and os.path.exists(d.shm_path) for d in descs)

    def read(self, handle: KVHandle, destinations: Sequence) -> TransferOp:
        views = check_destinations(handle, destinations)
        return start_read(self._executor, handle, lambda op: self._copy(handle, views, op))

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._copiers.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._mappings.clear()

    def _copy(self, handle: KVHandle, views: list[memoryview], op: TransferOp) -> None:
        sources = {region_id: self._map(handle, region_id)
                   for region_id in {block.region_id for block in handle.blocks}}
        for i, block in enumerate(handle.blocks):
            size = len(sources[block.region_id])
            if block.offset + block.length > size:
                raise TransferError(f"block {i} [{block.offset}, +{block.length}) is outside region "
                                    f"{block.region_id} ({size} bytes)")
        num_shards = min(self._num_copy_threads, len(views))
        # Contiguous shards: neighbouring blocks are often neighbours in memory too.
        bounds = [len(views) * k // num_shards for k in range(num_shards + 1)]
        shards = [self._copiers.submit(self._copy_shard, handle, views, sources, bounds[k], bounds[k + 1], op)
                  for k in range(num_shards)]
        # Wait for every shard before failing: the op must not end while a copy still writes
        # into the caller's blocks (they may be reused the moment it reports FAILED).
        futures.wait(shards)
        for shard in shards:
            shard.result()  # re-raises the first shard's TransferError

    @staticmethod
    def _copy_shard(handle: KVHandle, views: list[memoryview], sources: dict[RegionId, np.ndarray],
                    start: int, end: int, op: TransferOp) -> None:
        for i in range(start, end):
            if op.is_cancelled:
                return
            block, dest = handle.blocks[i], np.frombuffer(views[i], dtype=np.uint8)
            source = sources[block.region_id][block.offset:block.offset + block.length]
            sums = []
            # Piece by piece, each summed right after its copy while it is still in L2.
            for start in range(0, block.length, PIECE_BYTES):
                piece = dest[start:start + PIECE_BYTES]
                np.copyto(piece, source[start:start + PIECE_BYTES])
                sums.append(chunk_sums(piece))
            actual = combine(sums[0] if len(sums) == 1 else np.concatenate(sums), block.length)
            if actual != block.checksum:
                raise mismatch(i, block.region_id, block.checksum, actual)

    def _map(self, handle: KVHandle, region_id: RegionId) -> np.ndarray:
        desc = handle.region(region_id)
        if desc is None or not desc.shm_path:
            raise TransferError(f"region {region_id} is not in the handle's shared-memory regions")
        if not os.path.basename(desc.shm_path).startswith(SHM_PREFIX):
            raise TransferError(f"region {region_id}: refusing to map {desc.shm_path!r}")
        try:
            inode = os.stat(desc.shm_path).st_ino
        except FileNotFoundError:
            raise TransferError(f"region {region_id} is gone ({desc.shm_path} missing: "
                                "the owner closed it or died)") from None
        with self._lock:
            self._sweep()
            cached = self._mappings.get(desc.shm_path)
            if cached is None or cached.inode != inode:
                cached = _Mapping(inode, self._open(desc))
                self._mappings[desc.shm_path] = cached
                while len(self._mappings) > MAX_CACHED_MAPPINGS:
                    del self._mappings[next(iter(self._mappings))]
            return cached.data

    @staticmethod
    def _open(desc: RegionDesc) -> np.ndarray:
        with open(desc.shm_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != desc.length:
                raise TransferError(f"region {desc.region_id}: file has {size} bytes, handle says {desc.length}")
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(mapping, dtype=np.uint8)

    def _sweep(self) -> None:
        """Drop mappings whose file was unlinked, so a dead region's memory is released."""
        now = time.monotonic()
        if now - self._last_sweep < SWEEP_INTERVAL_S:
            return
        self._last_sweep = now
        for path in [p for p in self._mappings if not os.path.exists(p)]:
            del self._mappings[path]
