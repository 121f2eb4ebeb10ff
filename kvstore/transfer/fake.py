"""In-process transport for tests of other components, with fault injection.

Regions live in one process-global table, so two engines in one test process see each other
the way two hosts would. Reads still run on a worker thread and verify checksums, so callers
exercise the same poll() path as with a real transport. Fault injection::

    fake.inject_failure("peer died")   # the next read fails with this error
    fake.inject_corruption()           # the next read flips a byte -> checksum mismatch
    fake.reset()                       # forget regions and pending faults (test teardown)
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from kvstore.transfer.base import (
    Transport, TransportOptions, TransferError, check_destinations, mismatch, start_read)
from kvstore.transfer.checksum import checksum
from kvstore.transfer.descriptors import KVHandle, RegionId
from kvstore.transfer.memory import MemoryRegion
from kvstore.transfer.state import TransferOp

_regions: dict[str, np.ndarray] = {}
_failures: list[str] = []
_corruptions: list[bool] = []
_lock = threading.Lock()


def inject_failure(error: str = "injected failure") -> None:
    with _lock:
        _failures.append(error)


def inject_corruption() -> None:
    with _lock:
        _corruptions.append(True)


def reset() -> None:
    with _lock:
        _regions.clear()
        _failures.clear()
        _corruptions.clear()


def _take(faults: list):
    with _lock:
        return faults.pop(0) if faults else None


class FakeTransport(Transport):
    name = "fake"

    def __init__(self, options: TransportOptions):
        self._executor = ThreadPoolExecutor(options.num_workers, thread_name_prefix="epd-fake")
        self._registered: set[str] = set()

    def register(self, region: MemoryRegion) -> None:
        with _lock:
            _regions[region.region_id] = region.buffer
        self._registered.add(region.region_id)

    def unregister(self, region_id: RegionId) -> None:
        with _lock:
            _regions.pop(region_id, None)
        self._registered.discard(region_id)

    def can_read(self, handle: KVHandle) -> bool:
        with _lock:
            return all(block.region_id in _regions for block in handle.blocks)

    def read(self, handle: KVHandle, destinations: Sequence) -> TransferOp:
        views = check_destinations(handle, destinations)
        return start_read(self._executor, handle, lambda op: self._copy(handle, views, op))

    def close(self) -> None:
        for region_id in list(self._registered):
            self.unregister(region_id)
        self._executor.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def _copy(handle: KVHandle, views: list[memoryview], op: TransferOp) -> None:
        failure = _take(_failures)
        if failure is not None:
            raise TransferError(failure)
        is_corrupt = _take(_corruptions) is not None
        for i, (block, view) in enumerate(zip(handle.blocks, views)):
            if op.is_cancelled:
                return
            with _lock:
                source = _regions.get(block.region_id)
            if source is None:
                raise TransferError(f"unknown region {block.region_id!r}")
            if block.offset + block.length > len(source):
                raise TransferError(f"block {i} [{block.offset}, +{block.length}) is outside region "
                                    f"{block.region_id!r} ({len(source)} bytes)")
            dest = np.frombuffer(view, dtype=np.uint8)
            dest[:] = source[block.offset:block.offset + block.length]
            if is_corrupt and i == 0:
                dest[0] ^= 0xFF
            actual = checksum(view)
            if actual != block.checksum:
                raise mismatch(i, block.region_id, block.checksum, actual)
