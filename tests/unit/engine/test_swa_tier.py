"""The SWA tier between engine instances in one process: a window published by one is read
one-sided by another, whose prompt then hits all of its block KV; the tier's region stays
within its capacity and gives evicted windows' slots back; a handle whose slots were reused
since fails its read (checksums) and the prompt replays; windows expire after their TTL. The
store's index of windows is a dict here (the real one: tests/integration/test_hybrid_cluster.py)."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.hit_rule import ModelKVShape, block_kv_tokens
from services.common.sampling_params import SamplingParams
from services.engine.serving.instance import EngineInstance, ServingConfig
from services.engine.serving.swa_tier import SWATier
from tests.factories import ManualClock, make_tiny_model_dir, random_prompts

W, B = 24, 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
END = block_kv_tokens(300, B, 300 // B, ModelKVShape())  # 288: a 300-token prompt's L1


class WindowIndex:
    """The store's index of windows, as a dict: (sequence hash, end) -> handle."""

    def __init__(self) -> None:
        self.handles = {}

    async def put_window(self, sequence_hash, window_end, handle) -> bool:
        self.handles[(sequence_hash, window_end)] = handle
        return True

    async def get_window(self, sequence_hash, window_end):
        return self.handles.get((sequence_hash, window_end))


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("hybrid-swa"), "qwen2", seed=5, num_hidden_layers=3,
                               use_sliding_window=True, sliding_window=W,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])


async def prefill(instance: EngineInstance, prompt: list[int], rid: str):
    stream = await instance.seam.add(prompt, GREEDY, rid)
    return [out async for out in stream][-1]


async def copy_blocks(source: EngineInstance, target: EngineInstance, prompt: list[int]) -> None:
    """The prompt's full-attention blocks, as the KV store would bring them."""
    export = await source.engine.call(source.llm.prefix.export_kv, prompt)
    await target.engine.call(target.llm.prefix.import_kv, export.blocks)
    await source.engine.call(source.llm.prefix.release, export)


def slots_in_use(tier: SWATier) -> int:
    return tier.area.slots.num_slots - tier.area.slots.num_free


def test_windows_move_between_instances_and_the_region_stays_bounded(hybrid_dir):
    prompts = random_prompts(4, [300] * 4, seed=50)

    async def main():
        config = ServingConfig(model=str(hybrid_dir), num_kv_blocks=128, device="cpu", max_num_batched_tokens=64)
        instances = [EngineInstance(config, "prefill") for _ in range(3)]
        clock, index = ManualClock(), WindowIndex()
        tiers = [SWATier(i.seam, i.transfer, index, i.instance_id, capacity_windows=2, ttl_s=180, clock=clock)
                 for i in instances]
        (a, b, c), (tier_a, tier_b, tier_c) = instances, tiers
        for instance in instances:
            instance.start()
        try:
            cold = [await prefill(a, p, f"cold{i}") for i, p in enumerate(prompts)]
            hashes = [(await a.seam.prompt_hashes(p))[0] for p in prompts]
            per_window = len(a.seam.window_positions(END))
            assert per_window == 2  # positions 265..287: blocks 16 and 17
            # What --swa-capacity-mib buys: 2 blocks of 2 layers' K and V, 16 x 2 x 16 floats.
            assert SWATier.window_bytes(a.seam) == 2 * 2 * 2 * 16 * 2 * 16 * 4 == 16384
            assert [SWATier.windows_in(a.seam, n) for n in (1000, 1 << 20, 1 << 30)] == [1, 63, 1024]
            assert await tier_a.publish(prompts[0], hashes[0], END)
            assert slots_in_use(tier_a) == per_window

            # b has the block KV (from the store) but not the window: with the tier, a whole hit.
            await copy_blocks(a, b, prompts[0])
            assert await tier_b.pull(prompts[0], hashes[0], END)
            out = await prefill(b, prompts[0], "hit")
            assert (out.num_cached_tokens, out.token_ids) == (END, cold[0].token_ids)

            # Two windows kept at most: each new one evicts the least recently used, whose slots
            # come back; prompts[3]'s window reuses prompts[0]'s slots.
            for t, i in ((10, 1), (20, 2), (30, 3)):
                clock.now = t
                assert await tier_a.publish(prompts[i], hashes[i], END)
                assert len(tier_a.pool) == 2 and slots_in_use(tier_a) == 2 * per_window
            # The index still names prompts[0]'s old slots: the read fails its checksums,
            # nothing is registered, and c replays the last 46 tokens before L1.
            await copy_blocks(a, c, prompts[0])
            assert not await tier_c.pull(prompts[0], hashes[0], END)
            out = await prefill(c, prompts[0], "replay")
            assert out.token_ids == cold[0].token_ids
            assert out.num_cached_tokens == (END - a.llm.model_config.replay_tokens) // B * B == 240

            # Past its TTL a window is gone here (the store's entry expires alike).
            key = hashes[2][END // B - 1]
            assert tier_a.pool.lookup(key, END)  # at 30: a hit renews it until 210
            clock.now = 211
            assert not tier_a.pool.lookup(key, END)
        finally:
            for tier, instance in zip(tiers, instances):
                tier.close()
                await instance.close()

    asyncio.run(main())
