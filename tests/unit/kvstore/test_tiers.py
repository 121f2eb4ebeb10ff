"""The store's host and disk tiers: round trips, TTL, eviction within capacity, restart, corruption."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore.hashing import block_hashes, root_hash
from kvstore.tiers import DiskTier, HostTier
from tests.factories import ManualClock

BLOCK = 4096
ROOT = root_hash(model="m", block_size=16, dtype="float32")
HASHES = block_hashes(list(range(16 * 40)), 16, ROOT)  # 40 chained block hashes


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


@pytest.fixture
def clock():
    return ManualClock(1000.0)


def test_host_tier_round_trip_ttl_and_capacity(clock):
    tier = HostTier(BLOCK, capacity_blocks=8, clock=clock, shm=False)
    try:
        for i, h in enumerate(HASHES[:20]):
            tier.put(h, data(i), ttl_s=100)
            assert len(tier.index) <= 8
        assert tier.lookup(HASHES[:12]) == 0  # the oldest were evicted (LRU)
        assert np.array_equal(tier.get(HASHES[19]), data(19))
        clock.now += 101
        assert tier.get(HASHES[19]) is None and tier.lookup(HASHES[12:20]) == 0
        tier.put(HASHES[0], data(0), ttl_s=100)  # expired blocks make room first
        assert np.array_equal(tier.get(HASHES[0]), data(0))
        with pytest.raises(ValueError, match="4096 bytes"):
            tier.put(HASHES[1], data(1)[:100], ttl_s=100)
    finally:
        tier.close()


def test_disk_tier_survives_a_restart(tmp_path, clock):
    tier = DiskTier(tmp_path, BLOCK, capacity_blocks=100, clock=clock, segment_bytes=10 * BLOCK)
    for i, h in enumerate(HASHES[:25]):
        tier.put(h, data(i), ttl_s=3600)
    tier.flush()
    assert tier.lookup(HASHES[:25]) == 25
    tier.close()
    reopened = DiskTier(tmp_path, BLOCK, capacity_blocks=100, clock=clock, segment_bytes=10 * BLOCK)
    try:
        assert reopened.lookup(HASHES[:25]) == 25
        assert all(reopened.get(h) == data(i).tobytes() for i, h in enumerate(HASHES[:25]))
    finally:
        reopened.close()
    clock.now += 3601  # expired while the node was down: not indexed again
    expired = DiskTier(tmp_path, BLOCK, capacity_blocks=100, clock=clock)
    assert expired.lookup(HASHES[:1]) == 0 and not list(tmp_path.iterdir())
    expired.close()


def test_a_corrupted_record_is_a_miss_not_wrong_data(tmp_path, clock):
    tier = DiskTier(tmp_path, BLOCK, capacity_blocks=100, clock=clock)
    try:
        for i, h in enumerate(HASHES[:3]):
            tier.put(h, data(i), ttl_s=3600)
        tier.flush()
        segment = next(tmp_path.iterdir())
        raw = bytearray(segment.read_bytes())
        raw[-BLOCK // 2] ^= 0x40  # a bit flip inside the last block's data
        segment.write_bytes(bytes(raw))
        assert tier.get(HASHES[2]) is None and tier.num_corrupt == 1
        assert tier.lookup(HASHES[:3]) == 2  # dropped: the next prefill recomputes that block
        assert tier.get(HASHES[1]) == data(1).tobytes()
    finally:
        tier.close()


def test_eviction_keeps_disk_within_capacity_and_deletes_dead_segments(tmp_path, clock):
    tier = DiskTier(tmp_path, BLOCK, capacity_blocks=10, clock=clock, segment_bytes=5 * (BLOCK + 64))
    try:
        for i, h in enumerate(HASHES):
            tier.put(h, data(i), ttl_s=3600)
        tier.flush()
        assert len(tier.index) == 10 and tier.lookup(HASHES[30:]) == 10
        on_disk = sum(f.stat().st_size for f in tmp_path.iterdir())
        assert on_disk <= 3 * 5 * (BLOCK + 64)  # live records span at most 3 segments of 5
    finally:
        tier.close()


def test_a_torn_tail_keeps_the_records_before_it(tmp_path, clock):
    tier = DiskTier(tmp_path, BLOCK, capacity_blocks=100, clock=clock)
    for i, h in enumerate(HASHES[:4]):
        tier.put(h, data(i), ttl_s=3600)
    tier.flush()
    tier.close()
    segment = next(tmp_path.iterdir())
    os.truncate(segment, segment.stat().st_size - 100)  # the node died mid-write
    reopened = DiskTier(tmp_path, BLOCK, capacity_blocks=100, clock=clock)
    try:
        assert reopened.lookup(HASHES[:4]) == 3
    finally:
        reopened.close()
