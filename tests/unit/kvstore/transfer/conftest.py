"""Factories for transfer tests: filled regions, engines that clean up, block layouts."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.transfer import MemoryRegion, TransferEngine
from kvstore.transfer import fake

BLOCK_BYTES = 64 << 10
NUM_BLOCKS = 16


def filled_region(num_bytes: int = BLOCK_BYTES * NUM_BLOCKS, seed: int = 0, shm: bool = True) -> MemoryRegion:
    region = MemoryRegion.allocate(num_bytes, shm=shm)
    region.buffer[:] = np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)
    return region


def block_ranges(num_blocks: int = NUM_BLOCKS, block_bytes: int = BLOCK_BYTES) -> list[tuple[int, int]]:
    """Every other block first, then the rest: out of order, like a real block table."""
    order = list(range(0, num_blocks, 2)) + list(range(1, num_blocks, 2))
    return [(i * block_bytes, block_bytes) for i in order]


def destinations(region: MemoryRegion, num_blocks: int = NUM_BLOCKS, block_bytes: int = BLOCK_BYTES) -> list:
    """Destination blocks in reverse order of the pool, so nothing lines up by accident."""
    return [region.buffer[(num_blocks - 1 - i) * block_bytes:(num_blocks - i) * block_bytes]
            for i in range(num_blocks)]


@pytest.fixture
def make_engine():
    engines: list[TransferEngine] = []

    def make(**kwargs) -> TransferEngine:
        kwargs.setdefault("timeout_s", 2.0)
        engine = TransferEngine(**kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def make_region():
    regions: list[MemoryRegion] = []

    def make(*args, **kwargs) -> MemoryRegion:
        region = filled_region(*args, **kwargs)
        regions.append(region)
        return region

    yield make
    for region in regions:
        region.close()


@pytest.fixture(autouse=True)
def _reset_fake():
    yield
    fake.reset()
