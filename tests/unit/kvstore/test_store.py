"""One store node, driven directly: puts read from a real writer region through the transfer
engine, acquires lend blocks that a real reader reads back; TTL, restart, corruption, eviction."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from kvstore.hashing import block_hashes, root_hash
from kvstore.retention import Retention
from kvstore.store import NodeLayout, StoreNode
from kvstore.transfer import TransferEngine, TransferState
from kvstore.transfer.descriptors import KVHandle
from tests.factories import BLOCK, KVWriter as Writer, ManualClock

HASHES = block_hashes(list(range(16 * 64)), 16, root_hash(model="m", block_size=16, dtype="float32"))


@pytest.fixture
def clock():
    return ManualClock(1000.0)


@pytest.fixture
def engines():
    made = []

    def make() -> TransferEngine:
        made.append(TransferEngine())
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def read_back(reader: TransferEngine, handle: KVHandle) -> list[np.ndarray]:
    out = [np.zeros(BLOCK, np.uint8) for _ in handle.blocks]
    assert reader.read(handle, out).wait(10) is TransferState.DONE
    return out


def make_node(engines, clock, **layout) -> StoreNode:
    settings = dict(block_bytes=BLOCK, host_capacity_bytes=32 * BLOCK)
    settings.update(layout)
    return StoreNode("node-a", NodeLayout(**settings), engines(), clock=clock,
                     retention=Retention(agent_ttl_s=100, chat_ttl_s=300))


def test_put_then_acquire_round_trips_the_bytes_and_the_lease_unpins(engines, clock):
    writer, node, reader = Writer(engines()), make_node(engines, clock), engines()
    result = node.put(HASHES[:10], writer.handle(range(10)))
    assert (result.num_stored, result.num_renewed, result.num_failed) == (10, 0, 0)
    assert node.put(HASHES[:10], writer.handle(range(10))).num_renewed == 10  # already held

    handle = node.acquire([*HASHES[:6], HASHES[20], HASHES[7]])  # a miss cuts the prefix
    assert len(handle.blocks) == 6 and node.host.num_pinned == 6
    for i, got in enumerate(read_back(reader, handle)):
        assert np.array_equal(got, writer.block(i))
    assert node.release(handle.lease_id) and node.host.num_pinned == 0 and not node.release(handle.lease_id)
    assert node.acquire([HASHES[30]]) is None
    assert node.lookup([HASHES[0], HASHES[30], HASHES[9]]) == [True, False, True]
    stats = node.stats()
    assert (stats.num_blocks, stats.num_hits, stats.num_misses, stats.num_leases) == (10, 6, 3, 0)
    node.close()


def test_ttl_follows_the_request_class_and_a_hit_renews_it(engines, clock):
    writer, node = Writer(engines()), make_node(engines, clock)
    node.put(HASHES[:2], writer.handle(range(2)), "agent")  # 100 s
    node.put(HASHES[2:4], writer.handle(range(2, 4)), "chat")  # 300 s
    clock.now += 90
    assert node.lookup(HASHES[:4]) == [True] * 4  # renews all four
    clock.now += 150  # 240 s after the renewal: agent blocks expired, chat ones live
    assert node.lookup(HASHES[:4]) == [False, False, True, True]
    assert node.acquire(HASHES[:4]) is None
    handle = node.acquire(HASHES[2:4])
    assert len(handle.blocks) == 2
    node.release(handle.lease_id)
    with pytest.raises(ValueError, match="unknown request class"):
        node.put(HASHES[5:6], writer.handle(range(5, 6)), "batch")
    node.close()


def test_lookups_alone_keep_blocks_servable(engines, clock, tmp_path):
    """A writer's lookup (to skip what is held) renews the tiers too, not just the node index."""
    writer = Writer(engines())
    node = make_node(engines, clock, disk_dir=str(tmp_path), disk_capacity_bytes=64 * BLOCK)
    node.put(HASHES[:3], writer.handle(range(3)), "chat")  # 300 s
    for _ in range(3):
        clock.now += 200
        assert node.lookup(HASHES[:3]) == [True] * 3
    handle = node.acquire(HASHES[:3])
    assert handle is not None and len(handle.blocks) == 3
    node.release(handle.lease_id)
    node.close()


def test_eviction_keeps_the_node_within_capacity_and_lent_blocks_intact(engines, clock):
    writer, node, reader = Writer(engines()), make_node(engines, clock, host_capacity_bytes=8 * BLOCK), engines()
    node.put(HASHES[:4], writer.handle(range(4)))
    lent = node.acquire(HASHES[:4])
    for start in range(4, 60, 8):
        node.put(HASHES[start:start + 8], writer.handle(range(start, start + 8)))
        stats = node.stats()
        assert stats.num_blocks <= 8 and stats.num_host_blocks <= 8
    assert node.lookup(HASHES[:4]) == [False] * 4  # evicted (least recently used) ...
    for i, got in enumerate(read_back(reader, lent)):  # ... but lent slots were not reused
        assert np.array_equal(got, writer.block(i))
    node.release(lent.lease_id)
    assert node.stats().num_blocks == 8 and node.host.num_pinned == 0
    node.close()


def test_a_source_that_fails_its_checksum_stores_nothing(engines, clock):
    writer, node = Writer(engines()), make_node(engines, clock)
    handle = writer.handle(range(3))
    writer.block(1)[0] ^= 0xFF  # changed after export: the read fails its checksum
    result = node.put(HASHES[:3], handle)
    assert (result.num_stored, result.num_failed) == (0, 3)
    assert node.lookup(HASHES[:3]) == [False] * 3 and len(node.host._free) == 32 + 64
    node.close()


def test_a_restart_keeps_disk_hits_and_a_corrupt_record_becomes_a_miss(engines, clock, tmp_path):
    writer, reader = Writer(engines()), engines()
    node = make_node(engines, clock, disk_dir=str(tmp_path), disk_capacity_bytes=64 * BLOCK)
    node.put(HASHES[:12], writer.handle(range(12)))
    node.flush()
    node.close()

    # Restarted without a block size: the one on disk is used, so disk hits are served at once.
    node = make_node(engines, clock, disk_dir=str(tmp_path), disk_capacity_bytes=64 * BLOCK, block_bytes=0)
    assert node.stats().num_blocks == 12 and node.stats().num_host_blocks == 0
    handle = node.acquire(HASHES[:12])  # read back from disk into host slots
    assert [np.array_equal(g, writer.block(i)) for i, g in enumerate(read_back(reader, handle))] == [True] * 12
    node.release(handle.lease_id)
    node.close()

    segment = next((tmp_path / f"block-{BLOCK}").glob("segment-*"))
    raw = bytearray(segment.read_bytes())
    record = len(raw) // 12
    raw[5 * record + record // 2] ^= 0xFF  # inside block 5's data
    segment.write_bytes(bytes(raw))
    node = make_node(engines, clock, disk_dir=str(tmp_path), disk_capacity_bytes=64 * BLOCK)
    handle = node.acquire(HASHES[:12])
    assert len(handle.blocks) == 5 and node.stats().num_corrupt == 1
    assert node.lookup(HASHES[5:6]) == [False]  # dropped: the next put stores it again
    node.release(handle.lease_id)
    clock.now += 301  # and the TTL holds across restarts
    assert node.acquire(HASHES[:5]) is None
    node.close()


def test_the_block_size_is_learnt_from_the_first_put(engines, clock):
    writer = Writer(engines())
    node = StoreNode("n", NodeLayout(host_capacity_bytes=16 * BLOCK), engines(), clock=clock)
    assert node.lookup(HASHES[:2]) == [False, False] and node.acquire(HASHES[:2]) is None
    node.put(HASHES[:2], writer.handle(range(2)))
    assert node.stats().block_bytes == BLOCK and node.stats().host_capacity_blocks == 16
    odd = dataclasses.replace(writer.handle(range(1)), blocks=(dataclasses.replace(
        writer.handle(range(1)).blocks[0], length=BLOCK // 2),))
    with pytest.raises(ValueError, match="4096 bytes"):
        node.put(HASHES[3:4], odd)
    node.close()


def test_lookups_answer_misses_at_once_while_the_first_put_makes_the_tiers(engines, clock, monkeypatch):
    """Seen under load: the host pool (a gigabyte) took seconds to touch while the node's lock was
    held, every lookup meanwhile missed its deadline and the engines skipped the node for 30 s."""
    import kvstore.store

    touching, go_on = threading.Event(), threading.Event()

    class SlowHostTier(kvstore.store.HostTier):
        def __init__(self, *args, **kwargs):
            touching.set()
            assert go_on.wait(10)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(kvstore.store, "HostTier", SlowHostTier)
    writer = Writer(engines())
    node = StoreNode("n", NodeLayout(host_capacity_bytes=16 * BLOCK), engines(), clock=clock)
    put = threading.Thread(target=node.put, args=(HASHES[:2], writer.handle(range(2))))
    put.start()
    try:
        assert touching.wait(10)
        answered = []
        lookup = threading.Thread(target=lambda: answered.append(node.lookup(HASHES[:2])))
        lookup.start()
        lookup.join(5)
        assert answered == [[False, False]] and node.acquire(HASHES[:2]) is None and node.stats().num_blocks == 0
    finally:
        go_on.set()
        put.join(10)
    assert node.lookup(HASHES[:2]) == [True, True]
    node.close()


def test_the_swa_tier_puts_gets_and_expires_windows(engines, clock):
    node = make_node(engines, clock, swa_ttl_s=180)
    node.put_window(HASHES[3], 64, b"window")
    assert node.has_window(HASHES[3], 64) and not node.has_window(HASHES[3], 48)
    assert node.get_window(HASHES[3], 64) == b"window"
    clock.now += 181
    assert node.get_window(HASHES[3], 64) is None
    node.close()
