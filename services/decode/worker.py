"""Life cycle of a request in the decode server.

::

    Generate RPC --> with a KV handle (from its prefill instance):
                       engine: held (not scheduled) --> reserve blocks (local prefix hits first;
                                                        no room: wait for some)
                       --> transfer: read the prompt's KV one-sided into the reserved blocks
                             poll(): waiting -> transferring -> done | failed
                       --> release the prefill's lease (its blocks go back to its pool)
                       --> done:   commit, the request joins continuous batching at its next token
                           failed: recompute the prompt here (same tokens, only slower), or fail
                                   the request (--kv-load-failure-policy fail)
                 --> without one (a request resumed after its decode instance failed, or a prefill
                     whose pool the transfer engine cannot reach): the KV store's hits for the
                     prompt and the tokens generated so far are read into the prefix cache, and
                     the request computes only the rest
                 --> stream token chunks until finished; a cancelled RPC aborts the request
                 --> while it runs, each block it fills goes to the KV store in the background
                     (one write at a time per request), so a request resumed elsewhere finds all
                     but its last blocks there; once finished, the rest, so the conversation's
                     next turn hits prompt and answer

The first output token came from prefill; decode continues after it (or after every token
generated so far, for a resumed request), so its seeded sampling stream, penalties and grammar
pick up exactly where the previous engine left off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from kvstore.transfer.descriptors import KVHandle
from services.common import metrics
from services.common.errors import DrainingError, EmbeddingsMissingError, KVLoadError
from services.common.wire import DecodeRequest, LoadReport, RequestSpec, TokenChunk
from services.engine.serving.embeddings import image_inputs, pin_cached_prefix, rows_missing_end, unpin
from services.engine.serving.instance import EngineInstance
from services.engine.serving.seam import Reservation
from services.engine.serving.staging import HANDOVER_PATH

logger = logging.getLogger(__name__)
TRANSFERS = metrics.counter("epd_kv_transfers_total", "KV hand-overs read by this decode instance, by result "
                            "(done; failed or none: the prompt was recomputed).", ["result"])
TRANSFER_BYTES = metrics.counter("epd_kv_transfer_bytes_total", "KV bytes read from prefill instances, by "
                                 "the transport that moved them (shm, tcp, nixl).", ["transport"])
TRANSFER_SECONDS = metrics.histogram("epd_kv_transfer_seconds", "Time to read one request's prompt KV.",
                                     buckets=metrics.INTER_TOKEN_BUCKETS_S)
RESUMED_TOKENS = metrics.counter(
    "epd_decode_resumed_tokens", "Context tokens (prompt + output so far) of requests resumed here after "
    "another decode instance failed them, by where their KV came from: cached (the KV store or this "
    "instance's prefix cache) or recomputed.", ["source"])
_NO_ROOM_WAIT_S = 0.01


ReleaseLease = Callable[[str, str], Awaitable[None]]
"""release(prefill_address, lease_id): tell the KV's owner it may free the blocks."""


class DecodeWorker:
    @classmethod
    def create(cls, config, release_lease: ReleaseLease) -> DecodeWorker:
        """The worker of a decode service with ``config`` (DecodeConfig), its instance built."""
        return cls(EngineInstance(config, "decode"), release_lease, config.kv_load_failure_policy)

    def __init__(self, instance: EngineInstance, release_lease: ReleaseLease,
                 kv_load_failure_policy: str = "recompute") -> None:
        self.instance = instance
        self.release_lease = release_lease
        self.kv_load_failure_policy = kv_load_failure_policy
        self.is_draining = False
        self.num_transfers_in_flight = 0
        self.num_recomputed = 0
        self._releases: set[asyncio.Task] = set()

    async def generate(self, req: DecodeRequest) -> AsyncIterator[TokenChunk]:
        if self.is_draining:
            raise DrainingError("this decode instance is draining")
        spec, seam, store = req.spec, self.instance.seam, self.instance.store
        rid = spec.request_id
        images = await image_inputs(spec, self.instance.transfer, self.instance.llm.model_config.hidden_size)
        context = [*spec.prompt_token_ids, *req.output_token_ids]
        if req.kv is None and store is not None:
            await store.pull(context, images, spec.cache_salt)
        pinned = None
        if req.kv is None and (num_tokens := rows_missing_end(spec)):
            # No rows came with the request (its KV was to come from prefill): what is not
            # cached here cannot be computed.
            pinned = await pin_cached_prefix(seam, context, images, spec.cache_salt, num_tokens)
            if pinned is None:
                raise KVLoadError(f"the KV of {rid}'s images is neither handed over nor cached here, and "
                                  "their rows were not sent: the request cannot go on here")
        try:
            stream = await seam.add(list(spec.prompt_token_ids), spec.params, rid,
                                    output_token_ids=req.output_token_ids, hold_for_kv=req.kv is not None,
                                    mm_inputs=images, cache_salt=spec.cache_salt)
        except BaseException:
            if req.kv is not None:
                await self._release(req.prefill_address, req.kv.lease_id)
            raise
        try:
            is_pulled = await self._load_kv(rid, req)
            num_sent = num_handed = len(req.output_token_ids)
            write_back = _WriteBack(store, spec, images, seam.block_size)
            async for out in stream:
                if num_sent == num_handed and req.num_migrations:
                    _count_resumed(rid, len(context), out.num_cached_tokens, write_back.block_size, store is not None)
                new = tuple(out.token_ids[num_sent:])
                # This engine sampled (and has logprobs for) the tokens after the handed-over ones.
                logprobs = tuple((out.logprobs or [])[num_sent - num_handed:])
                num_sent = len(out.token_ids)
                write_back.update([*spec.prompt_token_ids, *out.token_ids], is_finished=out.finished)
                yield TokenChunk(new, out.finish_reason, out.stop_reason, req.num_cached_tokens,
                                 not is_pulled, logprobs)
        finally:
            await stream.aclose()  # aborts an unfinished request; a held one frees its blocks
            if pinned is not None:
                await unpin(seam, pinned)

    async def _load_kv(self, rid: str, req: DecodeRequest) -> bool:
        """The held request's prompt KV read in (True) or to be recomputed here (False); a
        request added without a handle computes what its prefix-cache hits leave (False)."""
        if req.kv is None:
            TRANSFERS.labels("none").inc()
            if not req.num_migrations:  # a hand-over without KV (a resumed request is no hand-over)
                HANDOVER_PATH.labels("recompute").inc()
            return False
        seam = self.instance.seam
        try:
            reservation = await self._reserve(rid)
            is_pulled = await self._transfer(req.kv, reservation)
        finally:
            # Whatever happened, the prefill's blocks are no longer needed.
            task = asyncio.get_running_loop().create_task(self._release(req.prefill_address, req.kv.lease_id))
            self._releases.add(task)  # held: the loop keeps only weak references to tasks
            task.add_done_callback(self._releases.discard)
        TRANSFERS.labels("done" if is_pulled else "failed").inc()
        HANDOVER_PATH.labels("recompute" if not is_pulled else "staged" if seam.staging else "direct").inc()
        if is_pulled:
            await seam.commit(reservation, num_cached_tokens=req.num_cached_tokens)
        elif self.kv_load_failure_policy == "fail":
            # (aborting the held request, as the stream closes, frees the reservation)
            raise KVLoadError(f"the prompt's KV for {rid} could not be read from {req.prefill_address} "
                              "(--kv-load-failure-policy fail)")
        elif rows_missing_end(req.spec):
            # Retryable: the router moves the request to a decode instance with the image rows
            # (re-encoded), which recomputes the prompt.
            raise EmbeddingsMissingError(f"the prompt's KV for {rid} could not be read from {req.prefill_address} "
                                         "and its image rows were not sent here to recompute it from")
        else:
            self.num_recomputed += 1
            await seam.recompute(reservation)
        return is_pulled

    async def _reserve(self, rid: str) -> Reservation:
        seam = self.instance.seam
        while (reservation := await seam.reserve_held(rid)) is None:
            await asyncio.sleep(_NO_ROOM_WAIT_S)  # blocks free up as running requests finish
        return reservation

    async def _transfer(self, kv: KVHandle, reservation: Reservation) -> bool:
        """Read the prompt's KV into the reserved blocks past the local hits (and a hybrid
        model's window KV into its window blocks); False when it must be recomputed."""
        seam = self.instance.seam
        if [b.length for b in kv.blocks] != seam.position_bytes(reservation):
            logger.warning("KV handle %s does not match this engine's layout: recomputing", kv.lease_id)
            return False
        skip = reservation.num_local_blocks
        if skip == len(kv.blocks):
            return True
        wanted = KVHandle(kv.lease_id, kv.owner, kv.regions, kv.blocks[skip:])
        started = time.perf_counter()
        self.num_transfers_in_flight += 1
        try:
            error = await seam.read(reservation, wanted, range(skip, len(kv.blocks)))
        finally:
            self.num_transfers_in_flight -= 1
        if error is not None:
            logger.warning("KV transfer %s failed (%s): recomputing", kv.lease_id, error)
            return False
        TRANSFER_SECONDS.observe(time.perf_counter() - started)
        TRANSFER_BYTES.labels(seam.transport_for(wanted)).inc(wanted.num_bytes)
        return True

    async def until_released(self) -> None:
        """Once the releases sent so far have ended: a drain lets them reach their prefill
        instances (each would otherwise hold its KV, and its own drain, until the lease expires)."""
        await asyncio.gather(*self._releases, return_exceptions=True)

    async def _release(self, prefill_address: str, lease_id: str) -> None:
        try:
            await self.release_lease(prefill_address, lease_id)
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            logger.warning("could not release lease %s at %s: %s", lease_id, prefill_address, exc)

    def load_report(self) -> LoadReport:
        return self.instance.load_report(is_draining=self.is_draining,
                                         num_transfers_in_flight=self.num_transfers_in_flight)


def _count_resumed(rid: str, num_context: int, num_cached: int, block_size: int, has_store: bool) -> None:
    """A resumed request's first output: how much of its context the caches served. The last
    context token is always computed (it yields the next token's logits)."""
    RESUMED_TOKENS.labels("cached").inc(num_cached)
    RESUMED_TOKENS.labels("recomputed").inc(num_context - num_cached)
    num_cachable = (num_context - 1) // block_size * block_size  # full blocks, one token left to compute
    why = ("" if num_cached >= num_cachable else
           ": no KV store configured" if not has_store else
           ": the rest was not in the store (its last blocks still being written, or the store lost them)")
    logger.info("%s resumed here: %d of %d context tokens from the cache, %d recomputed%s",
                rid, num_cached, num_context, num_context - num_cached, why)


class _WriteBack:
    """A running request's KV, written to the store block by block as it fills (one write in
    flight at a time; a write covers every full block computed so far, the store skips what it
    holds), then in full once the request finishes."""

    def __init__(self, store, spec: RequestSpec, images, block_size: int) -> None:
        self.store, self.spec, self.images, self.block_size = store, spec, images, block_size
        self.num_blocks = 0
        self.writing: asyncio.Task | None = None

    def update(self, token_ids: list[int], is_finished: bool) -> None:
        """``token_ids``: prompt and output so far; all but the last have their KV computed."""
        if self.store is None:
            return
        if is_finished:
            self.store.push_soon(token_ids, self.images, self.spec.cache_salt, self.spec.request_class, window=True)
            return
        num_blocks = (len(token_ids) - 1) // self.block_size
        if num_blocks > self.num_blocks and (self.writing is None or self.writing.done()):
            self.num_blocks = num_blocks
            self.writing = self.store.push_soon(token_ids[:num_blocks * self.block_size], self.images,
                                                self.spec.cache_salt, self.spec.request_class)
