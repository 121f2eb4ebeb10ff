"""The host staging region a pool the transports cannot reach moves KV through (``--kv-staging on``
puts a CPU pool behind it, as a CUDA pool is): its slot allocator, and blocks lent and taken in
through it byte for byte, every slot back afterwards."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvstore.transfer.descriptors import KVHandle
from services.common.sampling_params import SamplingParams
from services.engine.seams import Handoff
from services.engine.serving.instance import EngineInstance, ServingConfig
from services.engine.serving.staging import StagingArea, StagingSlots, run_to_the_end
from tests.factories import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_slots_are_allocated_freed_once_and_none_when_full():
    slots = StagingSlots(4)
    a = slots.alloc(3)
    assert a.slots == [0, 1, 2] and slots.num_free == 1
    assert slots.alloc(2) is None and slots.num_free == 1  # nothing taken by a refusal
    b = slots.alloc(1)
    assert b.slots == [3] and slots.alloc(1) is None
    slots.free(a)
    slots.free(a)  # a second free is a no-op
    assert slots.num_free == 3
    assert sorted(slots.alloc(3).slots) == [0, 1, 2]
    assert slots.alloc(0).slots == []


def test_staging_copies_blocks_both_ways_into_their_slots():
    area = StagingArea.allocate(3 * 64 + 10, 64, region_id="test-staging")
    try:
        assert area.slots.num_slots == 3 and area.region.length == 3 * 64
        pool = torch.arange(5 * 64, dtype=torch.int32).to(torch.uint8).view(5, 64)
        lease = area.slots.alloc(2)
        area.copy_from_pool([pool[4], pool[1]], lease)
        assert area.ranges(lease) == [(0, 64), (64, 64)]
        assert bytes(area.region.buffer[:128]) == bytes(pool[4].numpy()) + bytes(pool[1].numpy())
        back = torch.zeros(2, 64, dtype=torch.uint8)
        area.copy_to_pool(lease, [back[1], back[0]])
        assert torch.equal(back[1], pool[4]) and torch.equal(back[0], pool[1])
        area.slots.free(lease)
    finally:
        area.close()


def test_a_cancelled_copy_is_waited_for():
    done = []

    def slow():
        import time
        time.sleep(0.1)
        done.append(True)

    async def main():
        task = asyncio.create_task(run_to_the_end(slow))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return list(done)

    assert asyncio.run(main()) == [True]  # cancelled only once the copy had ended


def staged_instance(model: str, role: str, staging: str = "on", mib: int = 1) -> EngineInstance:
    return EngineInstance(ServingConfig(model=model, num_kv_blocks=32, device="cpu", kv_staging=staging,
                                        kv_staging_mib=mib), role)


def test_a_staged_pool_is_not_registered_and_its_staging_is(tiny_llama_dir):
    async def main():
        staged = staged_instance(str(tiny_llama_dir), "prefill")
        direct = staged_instance(str(tiny_llama_dir), "decode", staging="auto")
        try:
            assert staged.region is None and staged.seam.can_transfer and not staged.seam.has_host_pool
            assert staged.staging.region_id.endswith("-staging")
            # 1 MiB of staging, but never more than the pool (32 blocks of 8 KiB).
            assert (staged.seam.block_bytes, staged.staging.slots.num_slots) == (8192, 32)
            assert direct.staging is None and direct.seam.has_host_pool  # auto on the CPU: direct
        finally:
            await staged.close()
            await direct.close()

    asyncio.run(main())


@pytest.mark.parametrize("importer_staging", ["on", "auto"], ids=["staged-to-staged", "staged-to-direct"])
def test_blocks_lent_and_taken_in_through_staging_arrive_byte_for_byte(tiny_llama_dir, importer_staging):
    prompt = random_prompts(1, [70], seed=3)[0]  # 4 full blocks and a partial one

    async def main():
        lender = staged_instance(str(tiny_llama_dir), "prefill")
        taker = staged_instance(str(tiny_llama_dir), "decode", staging=importer_staging)
        lender.start()
        taker.start()
        try:
            stream = await lender.seam.add_then_detach(prompt, GREEDY, "p")
            handoff = [item async for item in stream][-1]
            assert isinstance(handoff, Handoff)
            expected = [lender.llm.prefix.block_buffer(b).clone() for b in handoff.block_ids]
            export = await lender.seam.export_handoff(handoff, "lease-1")
            assert export.is_staged and export.pinned is None  # the pool blocks went back at once
            assert export.handle.regions[0].region_id == lender.staging.region_id
            assert lender.staging.slots.num_free == lender.staging.slots.num_slots - 5

            hashes, _ = await taker.seam.prompt_hashes(prompt)
            reservation = await taker.seam.reserve_prefix(prompt, hashes, 4)
            handle = export.handle
            first_four = KVHandle(handle.lease_id, handle.owner, handle.regions, handle.blocks[:4])
            assert await taker.seam.read(reservation, first_four, range(4)) is None
            got = [taker.llm.prefix.block_buffer(b).clone() for b in reservation.block_ids]
            await taker.seam.commit(reservation)
            assert all(torch.equal(g, e) for g, e in zip(got, expected[:4]))
            lender.seam.release(export)
            lender.seam.release(export)  # a second release is a no-op
            for instance in (lender, taker):
                if instance.staging is not None:
                    assert instance.staging.slots.num_free == instance.staging.slots.num_slots
            await lender.engine.call(lambda: None)  # the releases queued before it have run
        finally:
            await lender.close()
            await taker.close()

    asyncio.run(main())  # the no-leak check after the test sees every block free


def test_a_full_staging_region_falls_back_without_waiting(tiny_llama_dir):
    prompt = random_prompts(1, [70], seed=3)[0]

    async def main():
        instance = staged_instance(str(tiny_llama_dir), "prefill")
        instance.start()
        seam, slots = instance.seam, instance.staging.slots
        try:
            everything = slots.alloc(slots.num_slots)
            stream = await seam.add_then_detach(prompt, GREEDY, "p")
            handoff = [item async for item in stream][-1]
            assert await seam.export_handoff(handoff, "lease-1") is None  # its blocks released
            hashes, _ = await seam.prompt_hashes(prompt)
            assert await seam.export_prefix(prompt, hashes, 0, "put-1") is None
            other = random_prompts(1, [70], seed=4)[0]
            other_hashes, _ = await seam.prompt_hashes(other)
            reservation = await seam.reserve_prefix(other, other_hashes, 4)
            assert reservation.num_local_blocks == 0
            assert await seam.read(reservation, None, range(4)) == "the KV staging region is full"
            await seam.recompute(reservation)
            slots.free(everything)
            await instance.engine.call(lambda: None)
        finally:
            await instance.close()

    asyncio.run(main())


def test_the_staging_settings_are_checked_and_named():
    from services.common.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="--kv-staging / EPD_PREFILL_KV_STAGING: must be one of auto, on, off"):
        parse_config(ServingConfig, ["--kv-staging", "always"], "prefill", env={})
    with pytest.raises(ConfigError, match="--kv-staging-mib / EPD_DECODE_KV_STAGING_MIB: must be >= 1"):
        parse_config(ServingConfig, [], "decode", env={"EPD_DECODE_KV_STAGING_MIB": "0"})
