"""The block index, embedded and in Redis (one suite, same answers): prefix lookups, TTLs renewed
on hit, expired-first then LRU eviction."""

from __future__ import annotations

import itertools
import random

import pytest

from kvstore.index import EmbeddedIndex
from kvstore.mirrored_index import MirroredIndex
from kvstore.retention import DAY_S, Retention
from tests.factories import ManualClock
from tests.unit.kvstore.mirror_fakes import FakeMirror

_prefixes = itertools.count()


class FlushingIndex(MirroredIndex):
    """Publishes after every change, and checks that the mirror then holds what the index does."""

    def insert(self, block_hash, ttl_s, expires_at=None):
        evicted = super().insert(block_hash, ttl_s, expires_at)
        self._flush_and_compare()
        return evicted

    def remove(self, block_hash):
        is_removed = super().remove(block_hash)
        self._flush_and_compare()
        return is_removed

    def _flush_and_compare(self) -> None:
        self.flush()
        assert self.mirror.blocks == {h: (e.expires_at, e.ttl_s) for h, e in self.local.items()}


@pytest.fixture
def clock():
    return ManualClock()


@pytest.fixture(params=["embedded", "redis", "mirrored"])
def make_index(request):
    """Builds an index of each kind; Redis ones get a fresh key prefix each. A mirrored one (a
    store node's with Redis) decides with its embedded index and publishes after every call."""
    if request.param == "embedded":
        yield EmbeddedIndex
        return
    if request.param == "mirrored":
        yield lambda capacity, clock: FlushingIndex(EmbeddedIndex(capacity, clock), FakeMirror())
        return
    import redis

    from kvstore.redis_index import RedisIndex

    client = redis.Redis.from_url(request.getfixturevalue("redis_url"))
    yield lambda capacity, clock: RedisIndex(client, capacity, clock, prefix=f"test:{next(_prefixes)}")
    client.close()


def test_lookup_counts_the_leading_live_blocks_only(make_index, clock):
    index = make_index(10, clock)
    for h in "abc":
        index.insert(h, ttl_s=10)
    assert index.lookup(list("abc")) == 3
    assert index.lookup(list("abxc")) == 2
    assert index.lookup(list("xabc")) == 0


def test_present_answers_each_block_and_renews_only_live_ones(make_index, clock):
    index = make_index(10, clock)
    index.insert("a", ttl_s=10)
    index.insert("c", ttl_s=10)
    clock.now += 8
    assert index.present(list("abc")) == [True, False, True]
    assert index.present([]) == []
    clock.now += 8  # 16: both were renewed at 8, so they live until 18
    assert index.present(list("ac")) == [True, True]
    clock.now += 11
    assert index.present(list("ac")) == [False, False]


def test_ttl_expires_and_a_hit_renews_it(make_index, clock):
    index = make_index(10, clock)
    index.insert("a", ttl_s=10)
    index.insert("b", ttl_s=10)
    clock.now = 8
    assert index.lookup(["a"]) == 1  # a now lives until 18, b still until 10
    clock.now = 15
    assert index.lookup(["a"]) == 1 and index.lookup(["b"]) == 0
    clock.now = 30
    assert index.lookup(["a"]) == 0 and not index.is_live("a")


def test_expired_blocks_are_evicted_before_least_recently_used_ones(make_index, clock):
    index = make_index(3, clock)
    index.insert("short", ttl_s=5)
    index.insert("b", ttl_s=100)
    index.insert("c", ttl_s=100)
    clock.now = 1
    index.lookup(["short"])  # most recently used now, but it expires at 6
    clock.now = 7
    assert index.insert("d", ttl_s=100) == ["short"]
    assert index.insert("e", ttl_s=100) == ["b"]  # nothing expired: least recently used


def test_a_hit_protects_from_lru_eviction(make_index, clock):
    index = make_index(2, clock)
    index.insert("a", ttl_s=100)
    index.insert("b", ttl_s=100)
    index.lookup(["a"])
    assert index.insert("c", ttl_s=100) == ["b"]
    assert index.lookup(["a"]) == 1 and index.lookup(["c"]) == 1


def test_reinsert_renews_and_the_longer_ttl_wins(make_index, clock):
    index = make_index(4, clock)
    index.insert("a", ttl_s=Retention().ttl_s("agent"))
    clock.now = DAY_S
    assert index.insert("a", ttl_s=Retention().ttl_s("chat")) == []
    clock.now = 7.5 * DAY_S  # past the agent TTL, inside chat's renewed one
    assert index.lookup(["a"]) == 1 and len(index) == 1


def test_remove(make_index, clock):
    index = make_index(4, clock)
    index.insert("a", ttl_s=10)
    assert index.remove("a") and not index.remove("a") and index.lookup(["a"]) == 0


def test_random_replay_never_exceeds_capacity_and_agrees_with_a_model(make_index, clock):
    rng = random.Random(0)
    index = make_index(50, clock)
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


def test_two_redis_indexes_on_one_server_share_what_is_stored(redis_url, clock):
    import redis

    from kvstore.redis_index import RedisIndex

    client = redis.Redis.from_url(redis_url)
    node_1 = RedisIndex(client, 10, clock, prefix="shared")
    node_2 = RedisIndex(redis.Redis.from_url(redis_url), 10, clock, prefix="shared")
    node_1.insert(b"\x01" * 32, ttl_s=100)
    assert node_2.lookup([b"\x01" * 32]) == 1 and len(node_2) == 1
    assert node_2.remove(b"\x01" * 32) and node_1.lookup([b"\x01" * 32]) == 0
    ttl_ms = client.pttl("shared:b:" + "01" * 32)
    assert ttl_ms == -2  # removed keys are gone from Redis too
    node_1.insert(b"\x02" * 32, ttl_s=100)
    assert 0 < client.pttl("shared:b:" + "02" * 32) <= 100_000  # the key's TTL follows the block's
    node_2.clear()
    assert len(node_1) == 0 and node_1.lookup([b"\x02" * 32]) == 0 and not client.keys("shared:*")
    client.close()
    node_2.client.close()


def test_embedded_index_counts_why_it_evicted(clock):
    index = EmbeddedIndex(1, clock)
    index.insert("a", ttl_s=1)
    clock.now = 2
    index.insert("b", ttl_s=10)
    index.insert("c", ttl_s=10)
    assert (index.num_evicted_expired, index.num_evicted_lru) == (1, 1)


def test_retention_defaults_and_bad_input():
    assert Retention().ttl_s("agent") == 3 * DAY_S and Retention().ttl_s("chat") == 7 * DAY_S
    with pytest.raises(ValueError, match="request class"):
        Retention().ttl_s("batch")
    with pytest.raises(ValueError, match="chat_ttl_s"):
        Retention(chat_ttl_s=0)
