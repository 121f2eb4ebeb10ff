"""The store read path against an engine whose prefix cache changes while the store answers.

Between the lookup of a prompt's local prefix and the reservation of its blocks, other
requests run: they can cache more of the prompt (the local prefix grows) or evict it (it
shrinks). Each lent block must land at its own position in the prompt, under its own hash,
both ways; the request then continues exactly as if the store had never been asked.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvstore.transfer.engine import TransferEngine
from kvstore.transfer.memory import MemoryRegion
from services.engine import LLM, SamplingParams
from services.engine.serving.async_engine import AsyncEngine
from services.engine.engine import LLMEngine
from services.engine.serving.seam import EngineSeam
from services.engine.serving.store_connector import StoreConnector
from services.kvstore.client import Lent
from tests.factories import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ONE = SamplingParams(temperature=0, max_tokens=1)
BS = 16


class StoreDouble:
    """Holds a prompt's blocks in a registered shared-memory region, like a store node's host
    tier, and lends the leading ones it holds; ``meanwhile()`` runs while it "answers"."""

    def __init__(self, source: LLMEngine, prompt: list[int]) -> None:
        self.hashes, _ = source.prefix.prompt_hashes(prompt)
        export = source.prefix.export_kv(prompt, self.hashes)
        size = source.kv_block_bytes
        self.region = MemoryRegion.allocate(len(export.block_ids) * size, region_id="store-double")
        for i, block_id in enumerate(export.block_ids):
            self.region.buffer[i * size:(i + 1) * size] = source.prefix.block_buffer(block_id).numpy()
        self.data = {h: bytes(self.region.buffer[i * size:(i + 1) * size]) for i, h in enumerate(self.hashes)}
        source.prefix.release(export)
        self.size = size
        self.transfer = TransferEngine(transports=("shm",))
        self.transfer.register(self.region)
        self.meanwhile = None
        self.released: list[Lent] = []

    async def acquire_prefix(self, hashes) -> list[Lent]:
        if self.meanwhile is not None:
            await self.meanwhile()
        num = next((i for i, h in enumerate(hashes) if h not in self.data), len(hashes))
        first = self.hashes.index(hashes[0])
        handle = self.transfer.export(self.region.region_id,
                                      [((first + i) * self.size, self.size) for i in range(num)], "lease")
        return [Lent("store", handle, tuple(range(num)))] if num else []

    def release_soon(self, lent) -> None:
        self.released += lent

    def close(self) -> None:
        self.transfer.close()
        self.region.close()


async def _generate(engine: AsyncEngine, prompt: list[int], params: SamplingParams, rid: str):
    last = None
    async for last in await engine.add(prompt, params, rid):
        pass
    return last


def _pull_then_generate(target: LLMEngine, store: StoreDouble, prompt: list[int], meanwhile) -> tuple[int, object]:
    """Pull ``prompt``'s store hits into ``target`` with ``meanwhile`` running during the
    store's answer; then generate it. (blocks read, the output)"""

    async def main():
        engine = AsyncEngine(target)
        engine.start()
        reader = TransferEngine(transports=("shm",))
        seam = EngineSeam(engine, reader, region_id="target-pool")  # (reads only: never exported)
        store.meanwhile = lambda: meanwhile(engine)
        try:
            num_read = await StoreConnector(seam, store).pull(prompt)
            return num_read, await _generate(engine, prompt, GREEDY, "after")
        finally:
            reader.close()
            await engine.stop()

    return asyncio.run(main())


def _registered_right(target: LLMEngine, store: StoreDouble) -> None:
    """Every block the target's prefix cache holds under one of the store's hashes holds that
    hash's KV (a block under the wrong hash would be served to every later request). Blocks the
    target computed itself may differ in the last bits (other chunk shapes, other sums)."""
    bm = target.block_manager
    for block_hash, data in store.data.items():
        block_id = bm._cached.get(block_hash)
        if block_id is not None:
            held = target.prefix.block_buffer(block_id).view(torch.float32)
            expected = torch.frombuffer(bytearray(data), dtype=torch.float32)
            assert torch.allclose(held, expected, atol=1e-4), f"block {block_id} holds another block's KV"


@pytest.fixture
def prompt_and_store(tiny_llama_dir):
    prompt = random_prompts(1, [150], seed=21)[0]          # 9 full blocks, all may hit (149 tokens)
    source = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    source.generate(prompt, ONE)
    store = StoreDouble(source.engine, prompt)
    reference = LLM(str(tiny_llama_dir), num_kv_blocks=64).generate(prompt, GREEDY)[0].token_ids
    yield prompt, store, reference
    store.close()


def test_the_local_prefix_grows_while_the_store_answers(tiny_llama_dir, prompt_and_store):
    prompt, store, reference = prompt_and_store
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    target = llm.engine
    llm.generate(prompt[:40], ONE)                           # 2 blocks cached when the lookup runs

    async def cache_more(engine):                            # ... 6 by the time blocks are reserved
        await _generate(engine, prompt[:100], ONE, "meanwhile")

    num_read, out = _pull_then_generate(target, store, prompt, cache_more)
    assert num_read == 3                                     # blocks 6, 7, 8: the rest were local
    _registered_right(target, store)
    assert out.num_cached_tokens == 9 * BS and out.token_ids == reference
    assert store.released, "the store's lease was not given back"


def test_the_local_prefix_is_evicted_while_the_store_answers(tiny_llama_dir, prompt_and_store):
    prompt, store, reference = prompt_and_store
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16)
    target = llm.engine
    llm.generate(prompt[:68], ONE)                           # 4 blocks cached when the lookup runs
    assert target.prefix.prompt_hashes(prompt)[1] == 4
    other = random_prompts(1, [200], seed=22)[0]

    async def evict(engine):                                 # 13 blocks for another prompt evict some
        await _generate(engine, other, ONE, "meanwhile")

    num_read, out = _pull_then_generate(target, store, prompt, evict)
    assert target.prefix.prompt_hashes(other)[1] >= 1               # the other prompt did take blocks
    _registered_right(target, store)
    assert num_read == 5                                     # blocks 4..8 read into their own places
    assert out.token_ids == reference
    assert store.released, "the store's lease was not given back"
