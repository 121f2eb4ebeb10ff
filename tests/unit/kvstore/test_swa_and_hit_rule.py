"""The SWA tier and the hit rule, driven directly with a model descriptor that declares a window."""

from __future__ import annotations

import pytest

from kvstore.hit_rule import ModelKVShape, block_kv_tokens, hit_tokens
from kvstore.swa import SWAPool
from tests.factories import ManualClock

PLAIN = ModelKVShape()
SWA = ModelKVShape(sliding_window=128, replay_tokens=127)  # one sliding-window layer


def test_swa_entries_live_180_s_from_their_last_hit():
    clock = ManualClock()
    pool = SWAPool(capacity_entries=2, clock=clock)
    pool.put(b"seq", 512, b"window")
    clock.now = 170
    assert pool.get(b"seq", 512) == b"window"  # renewed until 350
    assert not pool.lookup(b"seq", 640) and not pool.lookup(b"other", 512)
    clock.now = 340
    assert pool.lookup(b"seq", 512)
    clock.now = 600
    assert pool.get(b"seq", 512) is None


def test_swa_pool_stays_within_capacity():
    pool = SWAPool(capacity_entries=2, clock=ManualClock())
    for end in (16, 32, 48):
        pool.put(b"seq", end, b"x")
    assert len(pool) == 2 and not pool.lookup(b"seq", 16) and pool.lookup(b"seq", 48)


@pytest.mark.parametrize("prompt, hits, expected", [
    (1000, 62, 992),   # every full block, and tokens 992.. are computed
    (1024, 64, 1008),  # a fully cached prompt still computes its last block (margin 1 token)
    (1000, 10, 160),
    (10, 0, 0),
])
def test_plain_models_keep_one_token_to_compute(prompt, hits, expected):
    assert hit_tokens(prompt, 16, hits, PLAIN) == expected


@pytest.mark.parametrize("has_window, expected", [(True, 992), (False, 864)])
def test_sliding_window_models_follow_the_swa_tier(has_window, expected):
    # L = 1000: L1 = 62 full blocks = 992; without the window, a replay of 127 tokens from
    # 865, rounded down to a block: 864.
    asked = []

    def window(end: int) -> bool:
        asked.append(end)
        return has_window

    assert hit_tokens(1000, 16, 62, SWA, window) == expected and asked == [992]
    assert block_kv_tokens(1000, 16, 62, SWA) == 992  # the block KV read either way


def test_speculative_look_back_stays_out_of_the_hit():
    shape = ModelKVShape(sliding_window=128, replay_tokens=127, lookback=6)
    assert hit_tokens(1000, 16, 62, shape, lambda end: True) == 992  # 1000 - 7 = 993 -> 992
    assert hit_tokens(1000, 16, 62, ModelKVShape(lookback=16), lambda end: True) == 976


def test_prompts_shorter_than_a_replay_hit_nothing_without_their_window():
    assert hit_tokens(100, 16, 6, SWA, lambda end: False) == 0
    assert hit_tokens(100, 16, 6, SWA, lambda end: True) == 96
