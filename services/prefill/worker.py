"""Life cycle of a request in the prefill server.

::

    Prefill RPC --> KV store hits read into the prefix cache (StoreConnector.pull)
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
      Release RPC from decode, or lease expiry (30 s) --> blocks back to the pool

    meanwhile, off the request's path: the prompt's new full blocks are written to the KV
    store (StoreConnector.push), so the next prompt with this prefix hits on any instance.

The decode instance reads the blocks one-sided (shared memory or the transfer engine's data
server): nothing here runs per block while it reads, and the engine keeps stepping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass

from kvstore.transfer.descriptors import KVHandle
from kvstore.transfer.leases import LeaseTable
from services.common.errors import UnavailableError
from services.common.sampling_params import TokenLogprobs
from services.common.wire import LoadReport, RequestSpec
from services.engine.seams import Handoff
from services.engine.serving import EngineInstance, mm_inputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    finish_reason: str | None
    """None: decode continues; "stop" / "length" when the first token ended the request."""
    stop_reason: str | int | None
    num_cached_tokens: int
    kv: KVHandle | None
    first_token_logprobs: TokenLogprobs | None = None


class PrefillWorker:
    def __init__(self, instance: EngineInstance, lease_ttl_s: float = 30.0) -> None:
        self.instance = instance
        self.leases = LeaseTable(ttl_s=lease_ttl_s)
        self.is_draining = False

    async def prefill(self, spec: RequestSpec) -> PrefillResult:
        if self.is_draining:
            raise UnavailableError("this prefill instance is draining")
        engine, store = self.instance.engine, self.instance.store
        prompt, images = list(spec.prompt_token_ids), mm_inputs(spec)
        if store is not None:
            await store.pull(prompt, images, spec.cache_salt)
        stream = await engine.add(prompt, spec.params, spec.request_id, detach_after_first_token=True,
                                  mm_inputs=images, cache_salt=spec.cache_salt)
        try:
            last = None
            async for item in stream:
                last = item
        finally:
            await stream.aclose()
        if store is not None:
            store.push_soon(prompt, images, spec.cache_salt, spec.request_class)
        if not isinstance(last, Handoff):
            return PrefillResult(last.token_ids[0], last.finish_reason, last.stop_reason,
                                 last.num_cached_tokens, None, (last.logprobs or [None])[0])
        return dataclasses.replace(await self._export(last), first_token_logprobs=(last.logprobs or [None])[0])

    async def _export(self, handoff: Handoff) -> PrefillResult:
        engine = self.instance.engine
        first = handoff.output_token_ids[0]
        if self.instance.region is None:  # a device pool: decode recomputes the prompt
            engine.call_soon(engine.engine.release_handoff, handoff)
            return PrefillResult(first, None, None, handoff.num_cached_tokens, None)
        lease_id = self.leases.grant(lambda: engine.call_soon(engine.engine.release_handoff, handoff))
        try:
            # Checksums read every block once: off the event loop.
            handle = await asyncio.to_thread(
                self.instance.transfer.export, self.instance.region.desc.region_id,
                self.instance.block_ranges(handoff.block_ids), lease_id)
        except BaseException:
            self.leases.release(lease_id)
            raise
        return PrefillResult(first, None, None, handoff.num_cached_tokens, handle)

    def release(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

    async def expire_leases(self, period_s: float = 1.0) -> None:
        """Forever: give back the blocks of every lease nobody released in time."""
        while True:
            for lease_id in self.leases.expire():
                logger.warning("lease %s expired: its KV was never released by a decode instance", lease_id)
            await asyncio.sleep(period_s)

    def load_report(self) -> LoadReport:
        return self.instance.load_report(num_leases=len(self.leases), is_draining=self.is_draining)
