"""Life cycle of a request in the prefill server.

::

    Prefill RPC --> image rows lent by an encoder read one-sided (serving/embeddings.py); none
                    sent (the router's prefix hit): their blocks must be cached, pinned here
        --> KV store hits read into the prefix cache (StoreConnector.pull)
        --> engine: waiting --> chunked prefill --> first token
                        |                                     |
                        |          finished by it? ---yes---> reply (no KV)
                        |                                     | no
                        |                            detach: blocks kept, request gone
                        v                                     v
                    leases: grant(lease) <-- export: KVHandle (region offsets + checksums)
                        |                                     |
                        |                                  reply (first token + handle)
                        v
      Release RPC from decode (or from the router: a request it abandoned, or whose KV no decode
      took), or lease expiry (30 s) --> blocks back to the pool

    meanwhile, off the request's path: the prompt's new full blocks are written to the KV
    store (StoreConnector.push), so the next prompt with this prefix hits on any instance.

The decode instance reads the blocks one-sided (shared memory or the transfer engine's data
server): nothing here runs per block while it reads, and the engine keeps stepping. A pool the
transports cannot reach (CUDA; --kv-staging on) lends copies in its host staging region instead,
and its blocks go back at once (serving/staging.py).

A lease is named by its request's id, so a router that gave up on a Prefill call can release
what the call may have lent without having seen the reply: this server cannot tell a reply that
reached the router from one the router dropped (the call ends the same way here). A Release of
a request still being prefilled here means its KV is not kept; whatever raises inside
:meth:`PrefillWorker.prefill` (a cancelled call included) leaves no blocks behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from kvstore.transfer.leases import LeaseTable
from services.common.errors import DrainingError, EmbeddingsMissingError
from services.common.wire import LoadReport, PrefillResponse, RequestSpec
from services.engine.seams import Handoff
from services.engine.serving.embeddings import image_inputs, pin_cached_prefix, rows_missing_end, unpin
from services.engine.serving.instance import EngineInstance
from services.engine.serving.staging import HANDOVER_PATH

logger = logging.getLogger(__name__)


class PrefillWorker:
    @classmethod
    def create(cls, config) -> PrefillWorker:
        """The worker of a prefill service with ``config`` (PrefillConfig), its instance built."""
        return cls(EngineInstance(config, "prefill"), lease_ttl_s=config.lease_ttl_s)

    def __init__(self, instance: EngineInstance, lease_ttl_s: float = 30.0) -> None:
        self.instance = instance
        self.leases = LeaseTable(ttl_s=lease_ttl_s)
        self.is_draining = False
        self._is_released_early: dict[str, bool] = {}
        """Request id of each prefill running here -> whether a Release for it came first."""

    async def prefill(self, spec: RequestSpec) -> PrefillResponse:
        if self.is_draining:
            raise DrainingError("this prefill instance is draining")
        self._is_released_early[spec.request_id] = False
        try:
            return await self._prefill(spec)
        finally:
            self._is_released_early.pop(spec.request_id, None)

    async def _prefill(self, spec: RequestSpec) -> PrefillResponse:
        seam, store = self.instance.seam, self.instance.store
        prompt = list(spec.prompt_token_ids)
        images = await image_inputs(spec, self.instance.transfer, self.instance.llm.model_config.hidden_size)
        if store is not None:
            await store.pull(prompt, images, spec.cache_salt)
        pinned = None
        if num_tokens := rows_missing_end(spec):  # the router skipped the encoder on a prefix hit
            pinned = await pin_cached_prefix(seam, prompt, images, spec.cache_salt, num_tokens)
            if pinned is None:
                raise EmbeddingsMissingError("the KV of the prompt's images is not cached here (evicted, or "
                                             "never computed): send their rows")
        try:
            last = await self._run(spec, prompt, images)
        except BaseException:
            if pinned is not None:  # the request is gone
                await unpin(seam, pinned)
            raise
        if pinned is not None:  # the request holds those blocks itself by now
            try:
                await unpin(seam, pinned)
            except BaseException:
                if isinstance(last, Handoff):  # cancelled meanwhile: nobody else has its blocks
                    seam.release(last)
                raise
        if store is not None:
            store.push_soon(prompt, images, spec.cache_salt, spec.request_class, window=True)
        if not isinstance(last, Handoff):
            return PrefillResponse(last.token_ids[0], last.finish_reason, last.stop_reason,
                                   last.num_cached_tokens, None, (last.logprobs or [None])[0])
        return dataclasses.replace(await self._export(last, spec.request_id),
                                   first_token_logprobs=(last.logprobs or [None])[0])

    async def _run(self, spec: RequestSpec, prompt: list[int], images) -> object:
        """The engine's last item for the request: its output, or its Handoff."""
        stream = await self.instance.seam.add_then_detach(prompt, spec.params, spec.request_id, mm_inputs=images,
                                                          cache_salt=spec.cache_salt)
        try:
            last = None
            async for item in stream:
                last = item
        finally:
            await stream.aclose()
        return last

    async def _export(self, handoff: Handoff, request_id: str) -> PrefillResponse:
        """The reply for a hand-over: its blocks lent under the lease ``request_id`` (no await
        between the export and the grant, so a cancelled call never strands an export)."""
        seam = self.instance.seam
        first = handoff.output_token_ids[0]
        if seam.can_transfer:  # None: the staging region is full (blocks released, as on failure)
            export = await seam.export_handoff(handoff, request_id)
        else:  # a device pool without staging
            seam.release(handoff)
            export = None
        if export is not None and self._is_released_early.get(request_id):
            seam.release(export)  # its caller left and said so before the lease existed
            export = None
        if export is None:  # decode recomputes the prompt
            HANDOVER_PATH.labels("recompute").inc()
            return PrefillResponse(first, None, None, handoff.num_cached_tokens, None)
        HANDOVER_PATH.labels("staged" if export.is_staged else "direct").inc()
        # A lease of the same request still here was lent to a call its caller never heard back
        # from (it retried here): nobody reads it.
        self.leases.release(request_id)
        self.leases.grant(lambda: seam.release(export), request_id)
        return PrefillResponse(first, None, None, handoff.num_cached_tokens, export.handle)

    def release(self, lease_id: str) -> bool:
        """Release the lease (named by its request id); idempotent. A request still being
        prefilled here keeps no KV once released (its caller left before the reply)."""
        if self.leases.release(lease_id):
            return True
        if lease_id in self._is_released_early:
            self._is_released_early[lease_id] = True
        return False

    async def expire_leases(self, period_s: float = 1.0) -> None:
        """Forever: give back the blocks of every lease nobody released in time."""
        while True:
            for lease_id in self.leases.expire():
                logger.warning("lease %s expired: its KV was never released by a decode instance", lease_id)
            await asyncio.sleep(period_s)

    def load_report(self) -> LoadReport:
        return self.instance.load_report(num_leases=len(self.leases), is_draining=self.is_draining)
