"""The embedded block index: prefix lookups, TTLs renewed on hit, expired-first then LRU eviction."""

from __future__ import annotations

import random

import pytest

from kvstore.index import EmbeddedIndex
from kvstore.retention import DAY_S, Retention


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


def test_lookup_counts_the_leading_live_blocks_only(clock):
    index = EmbeddedIndex(10, clock)
    for h in "abc":
        index.insert(h, ttl_s=10)
    assert index.lookup(list("abc")) == 3
    assert index.lookup(list("abxc")) == 2
    assert index.lookup(list("xabc")) == 0


def test_ttl_expires_and_a_hit_renews_it(clock):
    index = EmbeddedIndex(10, clock)
    index.insert("a", ttl_s=10)
    index.insert("b", ttl_s=10)
    clock.now = 8
    assert index.lookup(["a"]) == 1  # a now lives until 18, b still until 10
    clock.now = 15
    assert index.lookup(["a"]) == 1 and index.lookup(["b"]) == 0
    clock.now = 30
    assert index.lookup(["a"]) == 0 and not index.is_live("a")


def test_expired_blocks_are_evicted_before_least_recently_used_ones(clock):
    index = EmbeddedIndex(3, clock)
    index.insert("short", ttl_s=5)
    index.insert("b", ttl_s=100)
    index.insert("c", ttl_s=100)
    clock.now = 1
    index.lookup(["short"])  # most recently used now, but it expires at 6
    clock.now = 7
    assert index.insert("d", ttl_s=100) == ["short"]
    assert index.insert("e", ttl_s=100) == ["b"]  # nothing expired: least recently used
    assert (index.num_evicted_expired, index.num_evicted_lru) == (1, 1)


def test_a_hit_protects_from_lru_eviction(clock):
    index = EmbeddedIndex(2, clock)
    index.insert("a", ttl_s=100)
    index.insert("b", ttl_s=100)
    index.lookup(["a"])
    assert index.insert("c", ttl_s=100) == ["b"]
    assert index.lookup(["a"]) == 1 and index.lookup(["c"]) == 1


def test_reinsert_renews_and_the_longer_ttl_wins(clock):
    index = EmbeddedIndex(4, clock)
    index.insert("a", ttl_s=Retention().ttl_s("agent"))
    clock.now = DAY_S
    assert index.insert("a", ttl_s=Retention().ttl_s("chat")) == []
    clock.now = 7.5 * DAY_S  # past the agent TTL, inside chat's renewed one
    assert index.lookup(["a"]) == 1 and len(index) == 1


def test_remove(clock):
    index = EmbeddedIndex(4, clock)
    index.insert("a", ttl_s=10)
    assert index.remove("a") and not index.remove("a") and index.lookup(["a"]) == 0


def test_random_replay_never_exceeds_capacity_and_agrees_with_a_model(clock):
    rng = random.Random(0)
    index = EmbeddedIndex(50, clock)
    model: dict[str, list[float]] = {}  # block -> [expires_at, ttl], told of every eviction
    for step in range(5000):
        clock.now = step * 0.1
        block = f"b{rng.randrange(200)}"
        if rng.random() < 0.5:
            ttl = rng.choice([5.0, 50.0])
            for gone in index.insert(block, ttl_s=ttl):
                assert gone in model
                del model[gone]
            ttl = max(ttl, model.get(block, [0.0, 0.0])[1])
            model[block] = [clock.now + ttl, ttl]
        else:
            expected = block in model and model[block][0] > clock.now
            assert (index.lookup([block]) == 1) is expected
            if expected:
                model[block][0] = clock.now + model[block][1]
        assert len(index) == len(model) <= 50
    assert index.num_evicted_expired > 0 and index.num_evicted_lru > 0


def test_retention_defaults_and_bad_input():
    assert Retention().ttl_s("agent") == 3 * DAY_S and Retention().ttl_s("chat") == 7 * DAY_S
    with pytest.raises(ValueError, match="request class"):
        Retention().ttl_s("batch")
    with pytest.raises(ValueError, match="chat_ttl_s"):
        Retention(chat_ttl_s=0)
