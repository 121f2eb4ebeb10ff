"""The store connector's hit rule for a model that declares a sliding window: L1 when the SWA
tier has the window that ends there, L1 - window when it does not (SPEC.md's hit rule)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvstore.hashing import block_hashes, root_hash
from kvstore.hit_rule import ModelKVShape
from services.engine.serving.store_connector import StoreConnector

BS = 16
HASHES = block_hashes(list(range(BS * 100)), BS, root_hash(model="m", block_size=BS, dtype="float32"))


class WindowClient:
    """Answers has_window like a store's SWA tier that holds ``windows``; records the asks."""

    def __init__(self, windows: set[tuple[bytes, int]]) -> None:
        self.windows = windows
        self.asked: list[tuple[bytes, int]] = []

    async def has_window(self, sequence_hash: bytes, window_end: int) -> bool:
        self.asked.append((sequence_hash, window_end))
        return (sequence_hash, window_end) in self.windows


def connector(shape: ModelKVShape, client) -> StoreConnector:
    return StoreConnector(SimpleNamespace(block_size=BS), client, shape)


SWA = ModelKVShape(sliding_window=128, lookback=6)


def test_with_the_window_the_hit_is_l1():
    # L = 1000: at most 1000 - 134 = 866 tokens -> 54 blocks (864 tokens) of the 60 held.
    client = WindowClient({(HASHES[53], 864)})
    assert asyncio.run(connector(SWA, client)._apply_hit_rule(1000, HASHES, 60)) == 54
    assert client.asked == [(HASHES[53], 864)]


def test_without_the_window_the_hit_falls_back_by_one_window():
    client = WindowClient(set())
    assert asyncio.run(connector(SWA, client)._apply_hit_rule(1000, HASHES, 60)) == (864 - 128) // BS
    assert asyncio.run(connector(SWA, client)._apply_hit_rule(1000, HASHES, 5)) == 0  # 80 - 128 < 0


@pytest.mark.parametrize("num_held, expected", [(70, 62), (10, 10), (0, 0)])
def test_a_plain_model_keeps_one_token_and_never_asks_for_windows(num_held, expected):
    client = WindowClient(set())
    # L = 1000: at most 999 tokens -> 62 blocks.
    assert asyncio.run(connector(ModelKVShape(), client)._apply_hit_rule(1000, HASHES, num_held)) == expected
    assert client.asked == []
