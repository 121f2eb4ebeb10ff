"""Life cycle of a request in the decode server.

::

    Generate RPC --> engine: held (not scheduled) --> reserve blocks (local prefix hits first;
                                                      no room: wait for some)
                 --> transfer: read the prompt's KV one-sided into the reserved blocks
                       poll(): waiting -> transferring -> done | failed
                 --> release the prefill's lease (its blocks go back to its pool)
                 --> done:   commit, the request joins continuous batching at its next token
                     failed: recompute the prompt here (same tokens, only slower)
                 --> stream token chunks until finished; a cancelled RPC aborts the request
                 --> finished: the KV of prompt and answer goes to the KV store in the
                     background, so the conversation's next turn hits both

The first output token came from prefill; decode continues after it, so its seeded sampling
stream and penalties pick up exactly where prefill left off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from kvstore.transfer.descriptors import KVHandle
from services.common import metrics
from services.common.errors import UnavailableError
from services.common.sampling_params import TokenLogprobs
from services.common.wire import LoadReport, RequestSpec
from services.engine.seams import KVReservation
from services.engine.serving import EngineInstance, mm_inputs
from services.engine.store_connector import read_kv

logger = logging.getLogger(__name__)
TRANSFERS = metrics.counter("epd_kv_transfers_total", "KV hand-overs read by this decode instance, by result "
                            "(done; failed or none: the prompt was recomputed).", ["result"])
TRANSFER_BYTES = metrics.counter("epd_kv_transfer_bytes_total", "KV bytes read from prefill instances.")
TRANSFER_SECONDS = metrics.histogram("epd_kv_transfer_seconds", "Time to read one request's prompt KV.",
                                     buckets=metrics.INTER_TOKEN_BUCKETS_S)
_NO_ROOM_WAIT_S = 0.01


@dataclass(frozen=True)
class DecodeInput:
    spec: RequestSpec
    output_token_ids: tuple[int, ...]
    kv: KVHandle | None
    num_cached_tokens: int
    prefill_address: str


@dataclass(frozen=True)
class TokenChunk:
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: str | int | None
    num_cached_tokens: int
    kv_recomputed: bool
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per token, when the request asked for logprobs."""


ReleaseLease = Callable[[str, str], Awaitable[None]]
"""release(prefill_address, lease_id): tell the KV's owner it may free the blocks."""


class DecodeWorker:
    def __init__(self, instance: EngineInstance, release_lease: ReleaseLease) -> None:
        self.instance = instance
        self.release_lease = release_lease
        self.is_draining = False
        self.num_transfers_in_flight = 0
        self.num_recomputed = 0

    async def generate(self, req: DecodeInput) -> AsyncIterator[TokenChunk]:
        if self.is_draining:
            raise UnavailableError("this decode instance is draining")
        spec, engine = req.spec, self.instance.engine
        rid, images = spec.request_id, mm_inputs(spec)
        try:
            stream = await engine.add(list(spec.prompt_token_ids), spec.params, rid,
                                      output_token_ids=req.output_token_ids, hold_for_kv=True,
                                      mm_inputs=images, cache_salt=spec.cache_salt)
        except BaseException:
            if req.kv is not None:
                await self._release(req.prefill_address, req.kv.lease_id)
            raise
        try:
            is_pulled = await self._pull_kv(rid, req)
            TRANSFERS.labels("done" if is_pulled else "failed" if req.kv is not None else "none").inc()
            if is_pulled:
                await engine.call(engine.engine.commit_kv, rid, req.num_cached_tokens)
            else:
                self.num_recomputed += 1
                await engine.call(engine.engine.recompute_kv, rid)
            num_sent = num_handed = len(req.output_token_ids)
            async for out in stream:
                new = tuple(out.token_ids[num_sent:])
                # This engine sampled (and has logprobs for) the tokens after the handed-over ones.
                logprobs = tuple((out.logprobs or [])[num_sent - num_handed:])
                num_sent = len(out.token_ids)
                if out.finished and self.instance.store is not None:
                    self.instance.store.push_soon([*spec.prompt_token_ids, *out.token_ids], images,
                                                  spec.cache_salt, spec.request_class)
                yield TokenChunk(new, out.finish_reason, out.stop_reason, req.num_cached_tokens,
                                 not is_pulled, logprobs)
        finally:
            await stream.aclose()  # aborts an unfinished request; a held one frees its blocks

    async def _pull_kv(self, rid: str, req: DecodeInput) -> bool:
        """Read the prompt's KV into reserved blocks; False when it must be recomputed."""
        if req.kv is None:
            return False
        try:
            reservation = await self._reserve(rid)
            return await self._transfer(req.kv, reservation)
        finally:
            # Whatever happened, the prefill's blocks are no longer needed.
            asyncio.get_running_loop().create_task(self._release(req.prefill_address, req.kv.lease_id))

    async def _reserve(self, rid: str) -> KVReservation:
        engine = self.instance.engine
        while (reservation := await engine.call(engine.engine.reserve_kv, rid)) is None:
            await asyncio.sleep(_NO_ROOM_WAIT_S)  # blocks free up as running requests finish
        return reservation

    async def _transfer(self, kv: KVHandle, reservation: KVReservation) -> bool:
        llm = self.instance.llm
        if len(kv.blocks) != len(reservation.block_ids) or any(
                b.length != llm.kv_block_bytes for b in kv.blocks):
            logger.warning("KV handle %s does not match this engine's layout: recomputing", kv.lease_id)
            return False
        skip = reservation.num_local_blocks
        if skip == len(kv.blocks):
            return True
        destinations = [llm.block_buffer(b).numpy() for b in reservation.block_ids[skip:]]
        wanted = KVHandle(kv.lease_id, kv.owner, kv.regions, kv.blocks[skip:])
        started = time.perf_counter()
        self.num_transfers_in_flight += 1
        try:
            error = await read_kv(self.instance.transfer, wanted, destinations)
        finally:
            self.num_transfers_in_flight -= 1
        if error is not None:
            logger.warning("KV transfer %s failed (%s): recomputing", kv.lease_id, error)
            return False
        TRANSFER_SECONDS.observe(time.perf_counter() - started)
        TRANSFER_BYTES.inc(wanted.num_bytes)
        return True

    async def _release(self, prefill_address: str, lease_id: str) -> None:
        try:
            await self.release_lease(prefill_address, lease_id)
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            logger.warning("could not release lease %s at %s: %s", lease_id, prefill_address, exc)

    def load_report(self) -> LoadReport:
        return self.instance.load_report(is_draining=self.is_draining,
                                         num_transfers_in_flight=self.num_transfers_in_flight)
