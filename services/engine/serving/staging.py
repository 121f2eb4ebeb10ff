"""A host staging region for a KV pool the transfer engine cannot reach (a CUDA pool).

The transports move bytes of registered host regions only. An engine whose pool is device
memory (or, as a test mode on the CPU, a plain tensor: ``--kv-staging on``) registers a smaller
host region instead and moves each hand-over or store block through one of its slots::

    lending:   pool blocks --copy--> staging slots --> KVHandle of the slots (peers read them)
               the pool blocks go back at once; the slots when the lease ends (release)
    taking in: peer --one-sided read--> staging slots --copy--> reserved pool blocks --> commit

    staging region (one slot = one KV block, block_bytes each)
    +--------+--------+--------+-----+
    | slot 0 | slot 1 | slot 2 | ... |      slot s: bytes [s * block_bytes, (s + 1) * block_bytes)
    +--------+--------+--------+-----+

On CUDA the region is pinned (page-locked), the copies are issued ``non_blocking`` and
synchronized before a handle is given out or a reservation committed. No free slot is "no room"
(``None``): the caller falls back to recompute, it never waits.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch

from kvstore.transfer.memory import MemoryRegion
from services.common import metrics

logger = logging.getLogger(__name__)
T = TypeVar("T")

HANDOVER_PATH = metrics.counter(
    "epd_kv_handover_path_total", "Prefill -> decode hand-overs by the path their KV took, counted by the "
    "prefill that lent it and the decode that took it in: direct (a registered host pool), staged (through "
    "a host staging region: a device pool, or --kv-staging on) or recompute (no KV moved).", ["path"])
STAGING_FULL = metrics.counter("epd_kv_staging_full_total", "KV moves that found the staging region full and "
                               "fell back to recompute, by side (export, import).", ["side"])
STAGING_SLOTS_IN_USE = metrics.gauge("epd_kv_staging_slots_in_use", "Staging slots holding KV in transit.")


class SlotLease:
    """Staging slots held by one export or read; freed once (:meth:`StagingSlots.free`)."""

    def __init__(self, slots: list[int]) -> None:
        self.slots = slots
        self.is_freed = False


class StagingSlots:
    """Free-list allocator of ``num_slots`` fixed-size slots; thread-safe (a lease's expiry
    frees from wherever it runs)."""

    def __init__(self, num_slots: int, in_use: metrics.Gauge | None = None) -> None:
        """``in_use``: the gauge of slots held (default: the staging region's)."""
        assert num_slots > 0, num_slots
        self.num_slots = num_slots
        self._in_use = in_use or STAGING_SLOTS_IN_USE
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> SlotLease | None:
        """``n`` slots, or None when fewer are free (nothing is taken then)."""
        with self._lock:
            if n > len(self._free):
                return None
            slots = [self._free.pop() for _ in range(n)]
        self._in_use.inc(n)
        return SlotLease(slots)

    def free(self, lease: SlotLease) -> None:
        """Give the slots back; a second free of the same lease is a no-op."""
        with self._lock:
            if lease.is_freed:
                return
            lease.is_freed = True
            self._free.extend(reversed(lease.slots))
        self._in_use.dec(len(lease.slots))


class StagingArea:
    """The staging region (registered with the transfer engine by its owner), its slots, and the
    copies between slots and pool blocks."""

    def __init__(self, region: MemoryRegion, block_bytes: int, pin: bool = False,
                 in_use: metrics.Gauge | None = None) -> None:
        self.region = region
        self.block_bytes = block_bytes
        self.slots = StagingSlots(region.length // block_bytes, in_use)
        self._pinned_ptr = _pin(region.buffer) if pin else None

    @classmethod
    def allocate(cls, num_bytes: int, block_bytes: int, region_id: str, pin: bool = False,
                 in_use: metrics.Gauge | None = None) -> StagingArea:
        """A region of ``num_bytes`` rounded down to whole slots (at least one)."""
        num_slots = max(1, num_bytes // block_bytes)
        return cls(MemoryRegion.allocate(num_slots * block_bytes, region_id=region_id), block_bytes, pin, in_use)

    @property
    def region_id(self) -> str:
        return self.region.region_id

    def ranges(self, lease: SlotLease) -> list[tuple[int, int]]:
        """(offset, length) of each slot in the region, what a KVHandle names."""
        return [(s * self.block_bytes, self.block_bytes) for s in lease.slots]

    def views(self, lease: SlotLease) -> list[np.ndarray]:
        """Each slot's bytes, where a one-sided read lands."""
        buffer, size = self.region.buffer, self.block_bytes
        return [buffer[s * size:(s + 1) * size] for s in lease.slots]

    def copy_from_pool(self, blocks: Sequence[torch.Tensor], lease: SlotLease) -> None:
        """Pool blocks (flat uint8, host or device) into the slots; returns once they are there."""
        _copy(blocks, [torch.from_numpy(v) for v in self.views(lease)])

    def copy_to_pool(self, lease: SlotLease, blocks: Sequence[torch.Tensor]) -> None:
        """The slots into pool blocks; returns once they are there."""
        _copy([torch.from_numpy(v) for v in self.views(lease)], blocks)

    def close(self) -> None:
        if self._pinned_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None
        self.region.close()


def _copy(sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor]) -> None:
    assert len(sources) == len(destinations), (len(sources), len(destinations))
    devices = {t.device for t in (*sources, *destinations) if t.device.type == "cuda"}
    with torch.inference_mode():
        for src, dst in zip(sources, destinations):
            dst.copy_(src, non_blocking=bool(devices))
    for device in devices:  # the copies were asynchronous: done before anyone reads the bytes
        torch.cuda.synchronize(device)


def _pin(buffer: np.ndarray) -> int | None:
    """Page-lock the region for CUDA's asynchronous copies; its address (None: left pageable,
    the copies still work, synchronously)."""
    ptr = buffer.ctypes.data
    try:
        error = torch.cuda.cudart().cudaHostRegister(ptr, buffer.nbytes, 0)
    except Exception as exc:  # noqa: BLE001 - an optimisation, not a requirement
        logger.warning("could not pin the KV staging region (%s): copies stay synchronous", exc)
        return None
    if int(error) != 0:
        logger.warning("could not pin the KV staging region (cudaHostRegister: %s)", error)
        return None
    return ptr


async def run_to_the_end(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on a worker thread. A cancelled caller still waits (without blocking the
    event loop, through further cancellations) until ``fn`` has returned, then is cancelled:
    the slots and blocks ``fn`` copies between may be freed only after that."""
    future = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.wait([future])
            except asyncio.CancelledError:
                continue
        raise
