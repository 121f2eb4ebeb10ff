"""The SWA tier on an engine instance: SPEC's "SWA KV: host memory pool of the instance, one
copy, ~180 s TTL; a remote hit is pulled over the network".

A hybrid model's prompt hits all of its block KV, up to L1 (kvstore/hit_rule.py), only when the
sliding-window KV ending at L1 is there too; otherwise the engine replays the last
ModelConfig.replay_tokens before L1 (kv_groups.PrefixHit). So the prefill that computed a
prompt keeps that window for a while, and any instance may read it::

    publish (after a prefill)
        seam.export_window(L1) --> copied into slots of this instance's SWA region (registered
        with the transfer engine; kvstore/swa.SWAPool keeps them for its TTL, and hands back
        the slots of what it evicts) --> seam.release_window --> the slots' handle (ranges and
        checksums) put in the KV store under (hash of the block before L1, L1)

    pull (before a prefill, once the store's block KV is in)
        the engine lacks the window at L1 --> the store has a live handle for it
        --> seam.reserve_window --> read one-sided from the instance that holds it --> seam.fill_window:
        admission then hits L1

A slot reused since the handle was published fails its checksum; a publisher that died fails
the read; an entry past its TTL is gone from the store: each only costs the replay, so every
failure here is logged and skipped.
"""

from __future__ import annotations

import logging
import time
import uuid

import torch

from kvstore.hashing import BlockHash
from kvstore.index import Clock
from kvstore.swa import DEFAULT_SWA_TTL_S, SWAPool
from kvstore.transfer.engine import TransferEngine
from services.common import metrics
from services.engine.serving.seam import EngineSeam
from services.engine.serving.staging import SlotLease, StagingArea, run_to_the_end

logger = logging.getLogger(__name__)

SWA_WINDOWS = metrics.counter("epd_swa_windows_total", "Sliding windows of a hybrid model by what became of "
                              "them: published (kept here, named in the KV store), pulled (read from an "
                              "instance for a prompt), missed (a prompt found none: it replays).", ["event"])
SWA_SLOTS_IN_USE = metrics.gauge("epd_swa_slots_in_use", "Blocks of this instance's SWA region holding windows.")


class SWATier:
    def __init__(self, seam: EngineSeam, transfer: TransferEngine, client, instance_id: str,
                 capacity_windows: int = 256, ttl_s: float = DEFAULT_SWA_TTL_S, clock: Clock = time.time) -> None:
        """``client``: a :class:`~services.kvstore.client.StoreClient` (the index of windows)."""
        self.seam = seam
        self.client = client
        self.transfer = transfer
        self.area = StagingArea.allocate((capacity_windows + 1) * self.window_bytes(seam),
                                         seam.window_block_bytes, f"{instance_id}-swa", in_use=SWA_SLOTS_IN_USE)
        transfer.register(self.area.region)
        self.pool: SWAPool[SlotLease] = SWAPool(capacity_windows, ttl_s, clock)

    @staticmethod
    def window_bytes(seam: EngineSeam) -> int:
        """One window's KV at most: ceil((W - 1) / B) window-pool blocks."""
        return -(-(seam.sliding_window - 1) // seam.block_size) * seam.window_block_bytes

    @classmethod
    def windows_in(cls, seam: EngineSeam, num_bytes: int, most: int = 1024) -> int:
        """How many windows ``num_bytes`` hold (at least one, at most ``most``: a small model's
        windows would otherwise fill the bytes with more than a TTL's traffic brings; the
        region has room for one more)."""
        return min(most, max(1, num_bytes // cls.window_bytes(seam) - 1))

    async def publish(self, token_ids: list[int], hashes: list[BlockHash], end: int) -> bool:
        """Keep the window ending at ``end`` here and name it in the store; False when it was
        evicted from the engine already, or the store did not take it."""
        positions = self.seam.window_positions(end)
        if end <= 0 or not positions:
            return False
        export = await self.seam.export_window(token_ids, hashes, end)
        if export is None:
            return False
        key = hashes[end // self.seam.block_size - 1]
        lease = self.area.slots.alloc(len(export.blocks))  # room for one more than the pool keeps
        try:
            assert lease is not None, "an SWA region sized for its pool's capacity"
            await run_to_the_end(self.area.copy_from_pool,
                                 [b.data.view(torch.uint8).view(-1) for b in export.blocks], lease)
        except BaseException:
            self._free(lease)
            raise
        finally:
            self.seam.release_window(export)
        for gone in self.pool.put(key, end, lease):
            self._free(gone)
        handle = self.transfer.export(self.area.region_id, self.area.ranges(lease), f"swa-{uuid.uuid4().hex}")
        if not await self.client.put_window(key, end, handle):
            return False
        SWA_WINDOWS.labels("published").inc()
        return True

    async def pull(self, token_ids: list[int], hashes: list[BlockHash], end: int) -> bool:
        """Bring the window ending at ``end`` into the engine's window pool (from wherever the
        store says it is); True when the engine has it now."""
        if end <= 0 or not self.seam.window_positions(end):
            return False
        if await self.seam.has_window(token_ids, hashes, end):
            return True
        handle = await self.client.get_window(hashes[end // self.seam.block_size - 1], end)
        if handle is None or len(handle.blocks) != len(self.seam.window_positions(end)):
            SWA_WINDOWS.labels("missed").inc()
            return False
        reservation = await self.seam.reserve_window(token_ids, hashes, end)
        if reservation is None:
            return False
        error = "cancelled"
        try:
            error = await self.seam.read(reservation, handle, range(len(handle.blocks)))
        finally:
            await self.seam.fill_window(reservation, end, arrived=error is None)
        if error is not None:
            logger.warning("reading the window ending at %d from %s failed (%s): the prompt replays",
                           end, handle.owner, error)
            SWA_WINDOWS.labels("missed").inc()
            return False
        SWA_WINDOWS.labels("pulled").inc()
        return True

    def _free(self, lease: SlotLease | None) -> None:
        if lease is not None:
            self.area.slots.free(lease)

    def close(self) -> None:
        self.transfer.unregister(self.area.region_id)
        self.area.close()
