"""Prefix hits from the KV store into an engine's pool, and new full blocks back to the store.

Before a prompt joins the engine (prefill)::

    prompt_hashes --> local prefix-cache hits (free) --> acquire the blocks after them on their
       holders --> hit rule: the block KV of at most L - margin tokens, L1 (kvstore/hit_rule.py)
       --> seam.reserve_prefix (local hits pinned) --> seam.read, one-sided
       --> seam.commit: the blocks that arrived join the local prefix cache --> release the leases
       --> a hybrid model: the sliding window ending at L1 from the SWA tier (swa_tier.py)
    then the request is added as usual and its admission hits those blocks (num_cached_tokens),
    or replays the window's tokens where the window did not come (kv_groups.PrefixHit).

After a request (prefill after its hand-over; decode as each block fills and once finished), off
the request's path::

    store lookup: skip what is held --> seam.export_prefix (the cached full blocks pinned)
       --> put the rest: the store nodes read them one-sided --> seam.release (unpin)
       --> a hybrid model (prefill, and decode once finished): the window at L1 published

A store that is down or slow only costs hits: every failure here is logged and skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from kvstore.hashing import BlockHash
from kvstore.hit_rule import ModelKVShape, block_kv_tokens
from kvstore.transfer.descriptors import KVHandle
from services.common import metrics
from services.engine.sequence import MultiModalInput
from services.engine.serving.seam import EngineSeam, Reservation
from services.engine.serving.swa_tier import SWATier

logger = logging.getLogger(__name__)

STORE_HIT_BLOCKS = metrics.counter("epd_kv_store_hit_blocks_total", "Blocks read from the KV store into the pool.")
STORE_LOOKUP_BLOCKS = metrics.counter("epd_kv_store_lookup_blocks_total",
                                      "Blocks looked up in the KV store (after local prefix-cache hits).")
STORE_PUT_BLOCKS = metrics.counter("epd_kv_store_put_blocks_total", "Blocks written to the KV store.")


class StoreConnector:
    def __init__(self, seam: EngineSeam, client, swa: SWATier | None = None,
                 shape: ModelKVShape = ModelKVShape()) -> None:
        """``client``: a :class:`~services.kvstore.client.StoreClient`; ``swa``: a hybrid model's
        SWA tier."""
        self.seam = seam
        self.client = client
        self.swa = swa
        self.shape = shape
        self._pushes: set[asyncio.Task] = set()

    @property
    def num_pushes_in_flight(self) -> int:
        return len(self._pushes)

    async def pull(self, token_ids: list[int], mm_inputs: tuple[MultiModalInput, ...] = (),
                   cache_salt: str = "") -> int:
        """Read the prompt's store hits into the engine's prefix cache; blocks read (0 on any
        store failure: the prompt is then computed, never failed)."""
        try:
            num_blocks = await self._pull(token_ids, mm_inputs, cache_salt)
        except Exception:  # noqa: BLE001 - a cache read: losing it only costs compute
            logger.exception("KV store read failed: computing the prompt")
            return 0
        if self.swa is not None:
            try:
                hashes, num_local = await self.seam.prompt_hashes(token_ids, mm_inputs, cache_salt)
                await self.swa.pull(token_ids, hashes, block_kv_tokens(len(token_ids), self.seam.block_size,
                                                                       num_local, self.shape))
            except Exception:  # noqa: BLE001 - a cache read: losing it only costs the replay
                logger.exception("SWA tier read failed: the prompt replays its window")
        return num_blocks

    async def _pull(self, token_ids: list[int], mm_inputs: tuple[MultiModalInput, ...], cache_salt: str) -> int:
        seam = self.seam
        if not seam.can_transfer:
            return 0  # a device pool without staging: store reads need host memory (see docs)
        bs = seam.block_size
        hashes, num_local = await seam.prompt_hashes(token_ids, mm_inputs, cache_salt)
        max_blocks = block_kv_tokens(len(token_ids), bs, len(hashes), self.shape) // bs
        if num_local >= max_blocks:
            return 0
        STORE_LOOKUP_BLOCKS.inc(max_blocks - num_local)
        lent = await self.client.acquire_prefix(hashes[num_local:max_blocks])
        try:
            num_held = sum(len(item.indices) for item in lent)
            num_blocks = block_kv_tokens(len(token_ids), bs, num_local + num_held, self.shape) // bs
            if num_blocks <= num_local:
                return 0
            # Other requests ran while the store answered: the local prefix may have grown (they
            # cached more blocks) or shrunk (evicted). The reservation is the one consistent
            # view from here on: each lent block goes to its own position in the prompt, and
            # only into the blocks the reservation allocated (past its own local hits).
            reservation = await seam.reserve_prefix(token_ids, hashes, num_blocks)
            if reservation is None:
                return 0
            filled: list[int] = []
            try:
                filled = await self._read(lent, num_local, reservation, num_blocks)
            finally:
                await seam.commit(reservation, filled)
        finally:
            self.client.release_soon(lent)
        STORE_HIT_BLOCKS.inc(len(filled))
        return len(filled)

    async def _read(self, lent: list, first: int, reservation: Reservation, num_blocks: int) -> list[int]:
        """Read the lent blocks the reservation has room for: lent index ``i`` is the prompt's
        block ``first + i``, wanted when it falls in [reservation's local hits, ``num_blocks``).
        The positions that arrived, in order (the leases stay with the caller)."""
        reads = []
        for item in lent:
            wanted = [j for j, i in enumerate(item.indices)
                      if reservation.num_local_blocks <= first + i < num_blocks]
            if wanted:
                handle = KVHandle(item.handle.lease_id, item.handle.owner, item.handle.regions,
                                  tuple(item.handle.blocks[j] for j in wanted))
                reads.append((item, [first + item.indices[j] for j in wanted], handle))
        errors = await asyncio.gather(*(self.seam.read(reservation, handle, positions)
                                        for _, positions, handle in reads))
        arrived: list[int] = []
        for (item, positions, _), error in zip(reads, errors):
            if error is None:
                arrived += positions
            else:
                logger.warning("reading %d blocks from store %s failed (%s): they are recomputed",
                               len(positions), item.address, error)
        return sorted(arrived)

    # ----- write-back ---------------------------------------------------------------------
    def push_soon(self, token_ids: list[int], mm_inputs: tuple[MultiModalInput, ...] = (),
                  cache_salt: str = "", request_class: str = "chat", window: bool = False) -> asyncio.Task | None:
        """Write the tokens' cached full blocks to the store in the background (``window``: and
        publish a hybrid model's window at their L1); the write's task (None: this pool cannot
        be written from)."""
        if not self.seam.can_transfer:
            return None
        task = asyncio.get_running_loop().create_task(self.push(token_ids, mm_inputs, cache_salt, request_class,
                                                                window))
        self._pushes.add(task)
        task.add_done_callback(self._pushes.discard)
        return task

    async def push(self, token_ids: list[int], mm_inputs: tuple[MultiModalInput, ...] = (),
                   cache_salt: str = "", request_class: str = "chat", window: bool = False) -> int:
        """Write the blocks the store lacks (and the window, see :meth:`push_soon`); how many
        node copies of blocks were stored or renewed."""
        try:
            hashes, _ = await self.seam.prompt_hashes(token_ids, mm_inputs, cache_salt)
        except Exception:  # noqa: BLE001 - the engine stopped
            logger.exception("KV store write-back failed before export")
            return 0
        num_put = await self._push_blocks(token_ids, hashes, request_class)
        if window and self.swa is not None:
            try:
                end = block_kv_tokens(len(token_ids), self.seam.block_size, len(hashes), self.shape)
                await self.swa.publish(token_ids, hashes, end)
            except Exception:  # noqa: BLE001 - a cache write: losing it only costs a later replay
                logger.exception("SWA tier write failed")
        return num_put

    async def _push_blocks(self, token_ids: list[int], hashes: list[BlockHash], request_class: str) -> int:
        seam = self.seam
        started = time.perf_counter()
        try:
            num_held = len(await self.client.lookup(hashes)) if hashes else 0
            export = await seam.export_prefix(token_ids, hashes, num_held, f"put-{uuid.uuid4().hex}")
        except Exception:  # noqa: BLE001 - the engine stopped; nothing stays pinned
            logger.exception("KV store write-back failed before export")
            return 0
        if export is None:
            return 0
        try:
            num_blocks = len(export.handle.blocks)
            num_put = await self.client.put(hashes[num_held:num_held + num_blocks], export.handle, request_class)
            STORE_PUT_BLOCKS.inc(num_blocks)
            logger.debug("wrote %d blocks to the KV store in %.3fs", num_blocks, time.perf_counter() - started)
            return num_put
        except Exception:  # noqa: BLE001 - a cache write: losing it only costs a later hit
            logger.exception("KV store write-back failed")
            return 0
        finally:
            seam.release(export)

    async def close(self) -> None:
        """Wait for the writes in flight (each ends on its own RPC timeout), then close."""
        if self._pushes:
            await asyncio.gather(*self._pushes, return_exceptions=True)
        await self.client.close()
        if self.swa is not None:
            self.swa.close()
