"""The one seam between an engine and the services that drive it.

The prefill and decode workers and the store connector reach their engine only through an
:class:`EngineSeam`. Each call that changes the engine runs on the engine thread between steps
(:class:`AsyncEngine`; ``prompt_hashes``, a read, does not wait for a step); the blocks this
engine lends out or takes in travel in two objects::

    lending (prefill's hand-over, KV store writes)                                 --> Export
        add_then_detach(...) --> stream ends with a Handoff --> export_handoff(handoff, lease)
        export_prefix(tokens, hashes, first_block, lease)
            Export.handle is what a peer reads one-sided; release(export) unpins the blocks

    taking in (decode's arriving prompt, KV store reads)                     --> Reservation
        reserve_held(request_id)              a held request's prompt (local prefix hits first)
        reserve_prefix(tokens, hashes, n)     a prompt's first n blocks, for the prefix cache
            --> read(reservation, handle, positions): one-sided into the reserved blocks
            --> commit(reservation, filled)   what arrived joins the engine
              | recompute(reservation)        nothing usable did: the engine computes it
            (aborting a held request also ends its reservation)

    a hybrid model's sliding windows, by the position they end at (swa_tier.py)
        export_window / release_window      lending, as export_prefix
        reserve_window --> read --> fill_window    taking in, as a prefix

A pool the transfer engine cannot reach (a CUDA pool; ``--kv-staging on`` on the CPU) moves its
blocks through a :class:`StagingArea` instead: an export copies them into staging slots (the
pool blocks go back at once, the slots at release) and a read lands in staging slots, then is
copied into the reserved blocks. No free slot: the export is None, the read fails (recompute).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.hashing import BlockHash
from kvstore.transfer.descriptors import KVHandle
from kvstore.transfer.engine import TransferEngine
from services.common.sampling_params import SamplingParams
from services.engine.seams import Handoff, KVExport, KVReservation
from services.engine.sequence import BlockId, MultiModalInput
from services.engine.serving.async_engine import AsyncEngine, RequestStream
from services.engine.serving.staging import STAGING_FULL, SlotLease, StagingArea, run_to_the_end


@dataclass
class Reservation:
    """Blocks reserved for KV that arrives from elsewhere: a held request's prompt
    (``request_id``), or a prompt prefix bound for the prefix cache (``token_ids``, ``hashes``).

    Position ``i`` is the prompt's block ``i``; the first ``num_local_blocks`` already hold their
    KV (local prefix-cache hits). Ended once: :meth:`EngineSeam.commit` or :meth:`EngineSeam.recompute`.
    """

    blocks: KVReservation
    request_id: str | None = None
    token_ids: list[int] | None = None
    hashes: list[BlockHash] | None = None

    @property
    def block_ids(self) -> list[BlockId]:
        return self.blocks.block_ids

    @property
    def num_local_blocks(self) -> int:
        return self.blocks.num_local_blocks

    @property
    def positions(self) -> list[tuple[int, BlockId]]:
        """(KV group, block) of each position a read may fill: the prompt's blocks, then a
        hybrid model's window blocks (a hand-over's handle lists them in the same order)."""
        return [(0, b) for b in self.blocks.block_ids] + [(1, b) for b in self.blocks.window_block_ids]


@dataclass
class Export:
    """Blocks pinned here for one-sided readers, named by ``handle`` (its lease id is the
    caller's); they stay pinned until :meth:`EngineSeam.release`. A staged export holds staging
    ``slots`` instead (its pool blocks, ``pinned`` None, went back once copied out)."""

    handle: KVHandle
    pinned: Handoff | KVExport | None
    slots: SlotLease | None = None

    @property
    def is_staged(self) -> bool:
        return self.slots is not None


class EngineSeam:
    def __init__(self, engine: AsyncEngine, transfer: TransferEngine, region_id: str | None,
                 staging: StagingArea | None = None) -> None:
        """``region_id``: the KV pool's region in ``transfer``; None for a pool peers cannot
        reach (a CUDA pool). Such a pool moves KV through ``staging`` (its region registered in
        ``transfer``); without it, its hand-overs carry no KV and decode recomputes (see docs)."""
        assert region_id is None or staging is None, "a registered pool needs no staging"
        self._engine = engine
        self._llm = engine.engine
        self._transfer = transfer
        self._region_id = region_id
        self.staging = staging

    @property
    def block_size(self) -> int:
        return self._llm.config.block_size

    @property
    def block_bytes(self) -> int:
        """A full-attention block's (every layer's, for a plain model): what the KV store holds."""
        return self._llm.kv_block_bytes

    def position_bytes(self, reservation: Reservation) -> list[int]:
        """The size of each of a reservation's positions: what a hand-over's handle must list."""
        sizes = (self._llm.kv_block_bytes, self._llm.window_block_bytes)
        return [sizes[group] for group, _ in reservation.positions]

    @property
    def has_host_pool(self) -> bool:
        """Whether peers can read this pool one-sided, and reads can land in it."""
        return self._region_id is not None

    @property
    def can_transfer(self) -> bool:
        """Whether KV moves in and out of this pool at all: directly, or through staging."""
        return self._region_id is not None or self.staging is not None

    # ----- requests -----------------------------------------------------------------------
    async def add(self, prompt: list[int], params: SamplingParams, request_id: str, *,
                  output_token_ids: tuple[int, ...] = (), hold_for_kv: bool = False,
                  mm_inputs: tuple[MultiModalInput, ...] = (), cache_salt: str = "") -> RequestStream:
        """A request and the stream of its outputs (see :meth:`AsyncEngine.add`); with
        ``hold_for_kv`` it waits, unscheduled, for its prompt's KV (:meth:`reserve_held`)."""
        return await self._engine.add(prompt, params, request_id, output_token_ids, hold_for_kv,
                                      mm_inputs=mm_inputs, cache_salt=cache_salt)

    async def add_then_detach(self, prompt: list[int], params: SamplingParams, request_id: str, *,
                              mm_inputs: tuple[MultiModalInput, ...] = (), cache_salt: str = "") -> RequestStream:
        """The prefill hand-over: the request leaves the engine right after its first token
        unless that token finished it; the stream's last item is then its :class:`Handoff`,
        whose blocks stay allocated until released here (:meth:`export_handoff`, :meth:`release`)."""
        return await self._engine.add(prompt, params, request_id, detach_after_first_token=True,
                                      mm_inputs=mm_inputs, cache_salt=cache_salt)

    # ----- lending blocks -----------------------------------------------------------------
    async def export_handoff(self, handoff: Handoff, lease_id: str) -> Export | None:
        """Name a hand-over's blocks for one-sided readers (checksummed off the event loop),
        a hybrid model's window blocks after the prompt's; should that fail, the blocks are
        released. None (blocks released): staging is full, or cannot take window blocks."""
        return await self._lend([(0, b) for b in handoff.block_ids] + [(1, b) for b in handoff.window_block_ids],
                                lease_id, handoff)

    async def export_prefix(self, token_ids: list[int], hashes: list[BlockHash], first_block: int,
                            lease_id: str) -> Export | None:
        """Pin the cached full blocks of ``token_ids`` and name those from ``first_block`` on;
        None (nothing stays pinned) when none are cached past it."""
        pinned = await self._engine.call(self._llm.prefix.export_kv, token_ids, hashes)
        block_ids = pinned.block_ids[first_block:]
        if not block_ids:
            self.release(pinned)
            return None
        return await self._lend([(0, b) for b in block_ids], lease_id, pinned)

    def release(self, lent: Export | Handoff) -> None:
        """Give lent blocks (or staging slots) back: queued for the engine thread, so safe from
        any thread (a lease's expiry) and from a cancelled task; a second release is a no-op."""
        if isinstance(lent, Export):
            if lent.slots is not None:
                self.staging.slots.free(lent.slots)
            pinned = lent.pinned
        else:
            pinned = lent
        if isinstance(pinned, Handoff):
            self._engine.call_soon(self._llm.release_handoff, pinned)
        elif pinned is not None:
            self._engine.call_soon(self._llm.prefix.release, pinned)

    async def _lend(self, slots: list[tuple[int, BlockId]], lease_id: str, pinned: Handoff | KVExport) -> Export | None:
        """Name (KV group, block) ``slots``: ranges of the region that holds every pool."""
        if self._region_id is None and self.staging is None:
            self.release(pinned)
            raise RuntimeError("a pool peers cannot reach has nothing to export")
        if self.staging is not None:
            if any(group for group, _ in slots):  # its slots are full-attention blocks' size
                self.release(pinned)
                return None
            return await self._lend_staged([b for _, b in slots], lease_id, pinned)
        offsets, sizes = self._llm.runner.pool_offsets, (self._llm.kv_block_bytes, self._llm.window_block_bytes)
        try:
            handle = await asyncio.to_thread(self._transfer.export, self._region_id,
                                             [(offsets[g] + b * sizes[g], sizes[g]) for g, b in slots], lease_id)
        except BaseException:
            self.release(pinned)
            raise
        return Export(handle, pinned)

    async def _lend_staged(self, block_ids: list[BlockId], lease_id: str,
                           pinned: Handoff | KVExport) -> Export | None:
        """Copy the blocks into staging slots and name those; the pool blocks go back either way."""
        staging = self.staging
        slots = staging.slots.alloc(len(block_ids))
        if slots is None:
            STAGING_FULL.labels("export").inc()
            self.release(pinned)
            return None
        blocks = [self._llm.prefix.block_buffer(block_id) for block_id in block_ids]

        def copy_and_describe() -> KVHandle:
            staging.copy_from_pool(blocks, slots)
            return self._transfer.export(staging.region_id, staging.ranges(slots), lease_id)

        try:
            handle = await run_to_the_end(copy_and_describe)
        except BaseException:
            staging.slots.free(slots)
            raise
        finally:
            self.release(pinned)  # copied out (or failed): the pool needs them no longer
        return Export(handle, None, slots)

    # ----- taking blocks in ---------------------------------------------------------------
    async def prompt_hashes(self, token_ids: list[int], mm_inputs: tuple[MultiModalInput, ...] = (),
                            cache_salt: str = "") -> tuple[list[BlockHash], int]:
        """The full blocks' hashes as the request will have them, and how many leading ones
        the local prefix cache holds.

        Computed in a worker thread, not on the engine thread between steps: a request that
        arrived during a step would wait for its end just for these, then miss the next step too
        (measured: a burst of 8 prompts prefilled in three waves instead of two); nor on the event
        loop (a long prompt's hashes take milliseconds). The hashes are a function of the tokens;
        the local count reads the prefix cache while steps may change it, so it can be stale by
        the time it is used, as it could always be: every caller re-checks the local prefix when
        it reserves (:meth:`reserve_prefix`)."""
        return await asyncio.to_thread(self._llm.prefix.prompt_hashes, token_ids, mm_inputs, cache_salt)

    async def reserve_held(self, request_id: str) -> Reservation | None:
        """Blocks for a held request's prompt, local prefix hits first; None: no room now."""
        blocks = await self._engine.call(self._llm.reserve_kv, request_id)
        return None if blocks is None else Reservation(blocks, request_id=request_id)

    async def reserve_prefix(self, token_ids: list[int], hashes: list[BlockHash],
                             num_blocks: int) -> Reservation | None:
        """Blocks for a prompt's first ``num_blocks`` blocks, local hits pinned (from here on
        the one view of the local prefix: other requests may have cached or evicted some of it
        since :meth:`prompt_hashes`); None: no room now."""
        blocks = await self._engine.call(self._llm.prefix.reserve_prefix, token_ids, hashes, num_blocks)
        return None if blocks is None else Reservation(blocks, token_ids=token_ids, hashes=hashes)

    def transport_for(self, handle: KVHandle) -> str:
        """The transport a read of ``handle`` takes (shm, tcp, nixl; "none" if none can reach it)."""
        return self._transfer.select_transport(handle) or "none"

    async def read(self, reservation: Reservation, handle: KVHandle, positions: Sequence[int]) -> str | None:
        """Read ``handle.blocks[i]`` one-sided into the reservation's block at ``positions[i]``
        (Reservation.positions); the error, or None when every block arrived (see :func:`read_kv`)."""
        where = reservation.positions
        destinations = [self._llm.prefix.block_buffer(where[p][1], where[p][0]) for p in positions]
        if self.staging is None:
            return await read_kv(self._transfer, handle, [d.numpy() for d in destinations])
        if any(where[p][0] for p in positions):
            return "the KV staging region holds full-attention blocks only, not window blocks"
        staging = self.staging
        slots = staging.slots.alloc(len(destinations))
        if slots is None:
            STAGING_FULL.labels("import").inc()
            return "the KV staging region is full"
        try:
            error = await read_kv(self._transfer, handle, staging.views(slots))
            if error is None:
                await run_to_the_end(staging.copy_to_pool, slots, destinations)
            return error
        finally:
            staging.slots.free(slots)

    async def commit(self, reservation: Reservation, filled: Sequence[int] | None = None,
                     num_cached_tokens: int = 0) -> None:
        """The blocks at positions ``filled`` (default: every one past the local hits) now hold
        their KV. A held request needs them all and starts generating (``num_cached_tokens``: what
        its prefill found cached); a prefix's blocks that arrived join the prefix cache, and
        every reserved block is unpinned (a block that did not arrive is computed later)."""
        rest = range(reservation.num_local_blocks, len(reservation.block_ids))
        if reservation.request_id is not None:
            assert filled is None or list(filled) == list(rest), "a held request needs its whole prompt"
            await self._engine.call(self._llm.commit_kv, reservation.request_id, num_cached_tokens)
        else:
            await self._engine.call(self._llm.prefix.fill_prefix, reservation.blocks, reservation.token_ids,
                                    reservation.hashes, list(rest if filled is None else filled))

    # ----- a hybrid model's sliding windows (swa_tier.py) ----------------------------------
    @property
    def sliding_window(self) -> int | None:
        return self._llm.model_config.sliding_window if self._llm.window_block_bytes else None

    @property
    def window_block_bytes(self) -> int:
        """A window-pool block's bytes; 0 for a model without sliding-window layers."""
        return self._llm.window_block_bytes

    def window_positions(self, end: int) -> range:
        return self._llm.prefix.window_positions(end)

    async def has_window(self, token_ids: list[int], hashes: list[BlockHash], end: int) -> bool:
        return await self._engine.call(self._llm.prefix.has_window, token_ids, hashes, end)

    async def export_window(self, token_ids: list[int], hashes: list[BlockHash], end: int) -> KVExport | None:
        """The window pool's blocks of the window ending at ``end``, pinned until
        :meth:`release_window`; None when one was evicted."""
        return await self._engine.call(self._llm.prefix.export_window, token_ids, hashes, end)

    def release_window(self, export: KVExport) -> None:
        self._engine.call_soon(self._llm.prefix.release_window, export)

    async def reserve_window(self, token_ids: list[int], hashes: list[BlockHash], end: int) -> Reservation | None:
        """Window-pool blocks for a window read from elsewhere (:meth:`read` fills them, its
        positions 0..); end it with :meth:`fill_window`. None: no room now."""
        blocks = await self._engine.call(self._llm.prefix.reserve_window, end)
        return None if blocks is None else Reservation(blocks, token_ids=token_ids, hashes=hashes)

    async def fill_window(self, reservation: Reservation, end: int, arrived: bool) -> None:
        await self._engine.call(self._llm.prefix.fill_window, reservation.blocks, reservation.token_ids,
                                reservation.hashes, end, arrived)

    async def recompute(self, reservation: Reservation) -> None:
        """Nothing usable arrived: the blocks go back and the engine computes the KV itself (a
        held request is scheduled now; a prefix by the request that wanted it)."""
        if reservation.request_id is not None:
            await self._engine.call(self._llm.recompute_kv, reservation.request_id)
        else:
            await self.commit(reservation, filled=())


async def read_kv(transfer: TransferEngine, handle: KVHandle, destinations: Sequence) -> str | None:
    """Read ``handle``'s blocks into ``destinations``; the error, or None when done.

    The wait is woken by the transfer's worker (no polling). Cancelling cancels the transfer and
    still waits, without blocking the event loop and through further cancellations, until the
    copy has stopped (after the block in flight): the destinations may be reused only then.
    """
    op = transfer.read(handle, destinations)
    try:
        await op.finished()
    except BaseException:
        op.cancel()
        while not op.poll().is_final:
            try:
                await op.finished()
            except asyncio.CancelledError:
                continue  # cancelled again: the copy still has to stop first
        raise
    return op.error
