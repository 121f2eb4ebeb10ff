"""Prefill and decode workers in one process, the KV moving through the real transfer engine:
the hand-over continues exactly, a corrupted or vanished transfer makes decode recompute (still
exactly), and every lease and block comes back."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import KVLoadError
from services.common.sampling_params import SamplingParams
from services.common.wire import DecodeRequest, RequestSpec
from services.decode.config import DecodeConfig
from services.decode.servicer import with_heartbeats
from services.decode.worker import DecodeWorker
from services.engine import LLM
from services.engine.serving.instance import EngineInstance
from services.engine.serving.staging import HANDOVER_PATH
from services.prefill.config import PrefillConfig
from services.prefill.worker import PrefillWorker
from tests.factories import random_prompts

PARAMS = SamplingParams(temperature=0.9, seed=11, max_tokens=10, ignore_eos=True, top_k=20)


async def disaggregated(model: str, prompt: list[int], damage=None, transport: str | None = None,
                        policy: str = "recompute", staging: tuple[str, str] = ("auto", "auto")):
    """``staging``: each side's --kv-staging (on: a pool the transports cannot reach, as on CUDA)."""
    prefill = PrefillWorker(EngineInstance(PrefillConfig(model=model, num_kv_blocks=64, device="cpu",
                                                         kv_staging=staging[0]), "prefill"))
    decode_instance = EngineInstance(DecodeConfig(model=model, num_kv_blocks=64, device="cpu",
                                                  kv_staging=staging[1]), "decode")

    async def release(address: str, lease_id: str) -> None:
        prefill.release(lease_id)

    decode = DecodeWorker(decode_instance, release, kv_load_failure_policy=policy)
    if transport is not None:
        read = decode_instance.transfer.read
        decode_instance.transfer.read = lambda handle, dest: read(handle, dest, transport=transport)
    prefill.instance.start()
    decode_instance.start()
    try:
        first = await prefill.prefill(RequestSpec("r", tuple(prompt), PARAMS))
        assert first.kv is not None and len(prefill.leases) == 1
        if damage is not None:
            damage(prefill, first.kv)
        try:
            chunks = [c async for c in decode.generate(DecodeRequest(
                RequestSpec("r", tuple(prompt), PARAMS), (first.first_token_id,), first.kv, 0, "unused"))]
        finally:
            await decode.until_released()  # the lease release runs as a task (a drain waits for it)
            assert len(prefill.leases) == 0
        assert len(prefill.leases) == 0
        for worker in (prefill, decode):
            engine = worker.instance.engine
            stats = await engine.call(engine.engine.stats)  # behind the releases queued so far
            assert stats.num_free_blocks == stats.num_total_blocks
            if worker.instance.staging is not None:  # every staging slot back too
                assert worker.instance.staging.slots.num_free == worker.instance.staging.slots.num_slots
        tokens = [first.first_token_id] + [t for c in chunks for t in c.token_ids]
        return tokens, chunks[-1].kv_recomputed
    finally:
        await prefill.instance.close()
        await decode_instance.close()


def corrupt(prefill: PrefillWorker, kv) -> None:
    block = kv.blocks[1]
    (prefill.instance.region or prefill.instance.staging.region).buffer[block.offset + 100] ^= 0xFF


def release_early(prefill: PrefillWorker, kv) -> None:
    """The lease expired before decode read: the owner freed (and may reuse) the blocks."""
    prefill.release(kv.lease_id)
    prefill.instance.transfer.unregister(kv.regions[0].region_id)


@pytest.mark.parametrize("damage, transport, is_recomputed", [
    (None, None, False), (None, "tcp", False), (corrupt, None, True), (release_early, "tcp", True)],
    ids=["shm", "tcp", "corrupted", "region-gone"])
def test_hand_over_is_exact_and_failures_recompute(tiny_llama_dir, damage, transport, is_recomputed):
    prompt = random_prompts(1, [150], seed=4)[0]
    expected = LLM(str(tiny_llama_dir), num_kv_blocks=64).generate(prompt, PARAMS)[0].token_ids
    tokens, recomputed = asyncio.run(disaggregated(str(tiny_llama_dir), prompt, damage, transport))
    assert tokens == expected and recomputed is is_recomputed


@pytest.mark.parametrize("staging, damage, paths", [
    (("on", "on"), None, ("staged", "staged")), (("on", "auto"), None, ("staged", "direct")),
    (("auto", "on"), None, ("direct", "staged")), (("on", "on"), corrupt, ("staged", "recompute"))],
    ids=["both", "prefill-only", "decode-only", "corrupted"])
def test_a_hand_over_through_staging_is_exact_and_returns_every_slot(tiny_llama_dir, staging, damage, paths):
    prompt = random_prompts(1, [150], seed=4)[0]
    expected = LLM(str(tiny_llama_dir), num_kv_blocks=64).generate(prompt, PARAMS)[0].token_ids
    counts = {path: HANDOVER_PATH.labels(path)._value.get() for path in ("direct", "staged", "recompute")}
    tokens, recomputed = asyncio.run(disaggregated(str(tiny_llama_dir), prompt, damage, staging=staging))
    assert tokens == expected and recomputed is (damage is not None)
    for path in paths:  # each side counts the path it saw: (prefill's export, decode's read)
        counts[path] += 1
    assert {path: HANDOVER_PATH.labels(path)._value.get() for path in counts} == counts


def test_the_fail_policy_fails_the_request_instead_of_recomputing(tiny_llama_dir):
    prompt = random_prompts(1, [150], seed=4)[0]
    with pytest.raises(KVLoadError, match="could not be read"):
        asyncio.run(disaggregated(str(tiny_llama_dir), prompt, corrupt, policy="fail"))
    # (the no-leak check after every test sees both engines' blocks back)


def test_streams_dropped_while_their_requests_are_added_leave_no_load(tiny_llama_dir):
    """Clients that leave right after the first token cancel decode's Generate while its add
    waits for the engine thread: the held requests must not stay behind as reported load."""
    import threading

    from kvstore.transfer.descriptors import Endpoint, KVHandle

    async def main():
        instance = EngineInstance(DecodeConfig(model=str(tiny_llama_dir), num_kv_blocks=64, device="cpu"), "decode")
        released: list[str] = []

        async def release(address: str, lease_id: str) -> None:
            released.append(lease_id)

        worker = DecodeWorker(instance, release)
        instance.start()
        busy = threading.Event()
        try:
            instance.engine.call_soon(busy.wait)  # a long step: every add waits in the queue
            prompt = tuple(random_prompts(1, [40], seed=5)[0])
            streams = [worker.generate(DecodeRequest(RequestSpec(f"r{i}", prompt, PARAMS), (7,),
                                                   KVHandle(f"lease-{i}", Endpoint("elsewhere", ""), (), ()), 0, "p"))
                       for i in range(10)]
            reads = [asyncio.create_task(anext(stream)) for stream in streams]
            await asyncio.sleep(0.05)
            for read in reads:
                read.cancel()
            busy.set()
            await asyncio.gather(*reads, return_exceptions=True)
            for _ in range(100):  # the load report's snapshot follows the engine thread's rounds
                await instance.engine.call(lambda: None)
                if worker.load_report().num_running == 0:
                    break
                await asyncio.sleep(0.01)
            return worker.load_report(), sorted(released)
        finally:
            busy.set()
            await instance.close()

    report, released = asyncio.run(main())
    assert (report.num_running, report.num_waiting, report.num_free_blocks) == (0, 0, 64)
    assert released == sorted(f"lease-{i}" for i in range(10))


async def _beats(items: list, delays_s: list[float], every_s: float) -> list:
    async def source():
        for item, delay_s in zip(items, delays_s):
            await asyncio.sleep(delay_s)
            yield item

    return [item async for item in with_heartbeats(source(), every_s)]


def test_heartbeats_fill_silences_without_losing_or_cancelling_items():
    got = asyncio.run(_beats(["a", "b", "c"], [0.0, 0.35, 0.0], every_s=0.1))
    assert [g for g in got if g is not None] == ["a", "b", "c"]
    assert 2 <= got.count(None) <= 4 and got[0] == "a" and got[-2:] == ["b", "c"]


def test_closing_the_heartbeats_cancels_the_pending_read():
    closed = asyncio.Event()

    async def source():
        try:
            yield "a"
            await asyncio.sleep(60)
            yield "b"
        finally:
            closed.set()

    async def main():
        beats = with_heartbeats(source(), 0.05)
        assert await anext(beats) == "a"
        assert await anext(beats) is None
        await beats.aclose()
        await asyncio.wait_for(closed.wait(), 1)

    asyncio.run(main())
