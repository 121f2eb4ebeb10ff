"""Prefill and decode workers in one process, the KV moving through the real transfer engine:
the hand-over continues exactly, a corrupted or vanished transfer makes decode recompute (still
exactly), and every lease and block comes back."""

from __future__ import annotations

import asyncio

import pytest

from services.common.sampling_params import SamplingParams
from services.common.wire import RequestSpec
from services.decode.config import DecodeConfig
from services.decode.worker import DecodeInput, DecodeWorker
from services.engine import LLM
from services.engine.serving import EngineInstance
from services.prefill.config import PrefillConfig
from services.prefill.worker import PrefillWorker
from tests.factories import random_prompts

PARAMS = SamplingParams(temperature=0.9, seed=11, max_tokens=10, ignore_eos=True, top_k=20)


async def disaggregated(model: str, prompt: list[int], damage=None, transport: str | None = None):
    prefill = PrefillWorker(EngineInstance(PrefillConfig(model=model, num_kv_blocks=64, device="cpu"), "prefill"))
    decode_instance = EngineInstance(DecodeConfig(model=model, num_kv_blocks=64, device="cpu"), "decode")

    async def release(address: str, lease_id: str) -> None:
        prefill.release(lease_id)

    decode = DecodeWorker(decode_instance, release)
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
        chunks = [c async for c in decode.generate(DecodeInput(
            RequestSpec("r", tuple(prompt), PARAMS), (first.first_token_id,), first.kv, 0, "unused"))]
        await asyncio.sleep(0.05)  # the lease release runs as a task
        assert len(prefill.leases) == 0
        for worker in (prefill, decode):
            stats = worker.instance.engine.stats
            assert stats.num_free_blocks == stats.num_total_blocks
        tokens = [first.first_token_id] + [t for c in chunks for t in c.token_ids]
        return tokens, chunks[-1].kv_recomputed
    finally:
        await prefill.instance.close()
        await decode_instance.close()


def corrupt(prefill: PrefillWorker, kv) -> None:
    block = kv.blocks[1]
    prefill.instance.region.buffer[block.offset + 100] ^= 0xFF


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
