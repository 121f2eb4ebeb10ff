"""The prefill worker's leases: named by the request, released idempotently, and never kept for
a request released (its caller gone) while it was still being prefilled, nor by one cancelled."""

from __future__ import annotations

import asyncio
import threading

from services.common.sampling_params import SamplingParams
from services.common.wire import RequestSpec
from services.engine.serving.instance import EngineInstance
from services.prefill.config import PrefillConfig
from services.prefill.worker import PrefillWorker
from tests.factories import random_prompts

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_a_lease_is_named_by_its_request_and_a_release_before_it_exists_keeps_no_kv(tiny_llama_dir):
    async def main():
        worker = PrefillWorker(EngineInstance(PrefillConfig(model=str(tiny_llama_dir), num_kv_blocks=64,
                                                            device="cpu"), "prefill"))
        prompt = tuple(random_prompts(1, [70], seed=3)[0])
        worker.instance.start()
        try:
            first = await worker.prefill(RequestSpec("r1", prompt, PARAMS))
            assert first.kv.lease_id == "r1" and "r1" in worker.leases
            assert worker.release("r1") and not worker.release("r1")  # a second release: a no-op

            busy = threading.Event()
            worker.instance.engine.call_soon(busy.wait)  # a long step: the next adds wait in the queue
            released = asyncio.ensure_future(worker.prefill(RequestSpec("r2", prompt, PARAMS)))
            cancelled = asyncio.ensure_future(worker.prefill(RequestSpec("r3", prompt, PARAMS)))
            await asyncio.sleep(0.05)
            assert not worker.release("r2")  # (nothing to release yet: the Release came first)
            cancelled.cancel()
            busy.set()
            assert (await released).kv is None  # prefilled, but its KV not kept: decode would recompute
            await asyncio.gather(cancelled, return_exceptions=True)
            assert cancelled.cancelled() and len(worker.leases) == 0
            engine = worker.instance.engine
            for _ in range(100):  # the releases run on the engine thread; read its stats there
                stats = await engine.call(engine.engine.stats)  # (the snapshot can lag a step)
                if stats.num_free_blocks == stats.num_total_blocks:
                    break
                await asyncio.sleep(0.01)
            assert stats.num_free_blocks == stats.num_total_blocks
        finally:
            await worker.instance.close()

    asyncio.run(main())
