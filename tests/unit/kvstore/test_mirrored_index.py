"""A store node's index with Redis: its own embedded index decides, Redis holds a published copy
for the other nodes. The copy follows every change, a failed publish is followed by a whole
re-publish (also when Redis lost it), and with Redis down the node serves its own blocks."""

from __future__ import annotations

import asyncio
import itertools
import socket

import pytest

from kvstore.hashing import block_hashes, root_hash
from kvstore.index import EmbeddedIndex
from kvstore.mirrored_index import MirroredIndex
from kvstore.store import NodeLayout, StoreNode
from kvstore.transfer import TransferEngine
from tests.factories import BLOCK, KVWriter, ManualClock
from tests.unit.kvstore.mirror_fakes import FakeMirror

HASHES = block_hashes(list(range(16 * 8)), 16, root_hash(model="m", block_size=16, dtype="float32"))
_prefixes = itertools.count()


@pytest.fixture
def clock():
    return ManualClock(1000.0)


def local_view(index: MirroredIndex) -> dict:
    return {h: (e.expires_at, e.ttl_s) for h, e in index.local.items()}


def test_the_copy_follows_inserts_hits_evictions_and_removals(clock):
    index = MirroredIndex(EmbeddedIndex(3, clock), FakeMirror())
    for h in "abc":
        index.insert(h, ttl_s=10)
    index.flush()  # the first flush publishes everything (what Redis held before is unknown)
    assert index.mirror.num_replaced == 1 and index.mirror.blocks == local_view(index)
    clock.now += 5
    assert index.lookup(["a"]) == 1  # renewed: a lives until 1015 now
    assert index.insert("d", ttl_s=10) == ["b"]
    assert index.remove("c") and not index.remove("zz")
    index.flush()
    assert index.mirror.blocks == {"a": (1015.0, 10), "d": (1015.0, 10)} == local_view(index)
    assert index.mirror.num_published == 1 and not index.has_work
    index.flush()  # nothing changed: no call at all
    assert index.mirror.num_published == 1


def test_while_redis_is_down_the_node_decides_alone_and_republishes_everything_after(clock):
    index = MirroredIndex(EmbeddedIndex(4, clock), FakeMirror())
    index.insert("a", ttl_s=10)
    index.flush()
    index.mirror.is_down = True
    index.insert("b", ttl_s=10)
    with pytest.raises(Exception, match="Redis is down"):
        index.flush()
    assert index.needs_resync
    for h in "cde":  # inserts, hits and an eviction, all decided locally
        index.insert(h, ttl_s=10)
    assert index.lookup(list("bcde")) == 4 and len(index) == 4 and index.present(["a"]) == [False]
    with pytest.raises(Exception, match="Redis is down"):
        index.flush()
    index.mirror.is_down = False
    index.flush()
    assert index.mirror.blocks == local_view(index) and set(index.mirror.blocks) == set("bcde")
    assert index.num_resyncs == 2 and not index.needs_resync


def test_a_copy_redis_lost_is_published_again(clock):
    index = MirroredIndex(EmbeddedIndex(4, clock), FakeMirror())
    index.insert("a", ttl_s=10)
    index.flush()
    index.check_published()
    assert not index.has_work
    index.mirror.lose_everything()
    index.check_published()
    index.flush()
    assert index.mirror.blocks == local_view(index) and index.num_resyncs == 2


def test_a_real_redis_copy_matches_the_node_index_and_peeking_renews_nothing(redis_url, clock):
    import redis

    from kvstore.redis_index import RedisIndex

    client = redis.Redis.from_url(redis_url)
    prefix = f"test-mirror:{next(_prefixes)}"
    try:
        copy = RedisIndex(client, 4, clock, prefix=prefix)
        copy.insert(b"\x09" * 32, ttl_s=10)  # left by the node's previous run
        index = MirroredIndex(EmbeddedIndex(4, clock), copy)
        index.clear()  # what a node does at start
        blocks = HASHES[:6]
        for h in blocks:
            index.insert(h, ttl_s=10)
        index.flush()
        clock.now += 5
        index.lookup(blocks[2:4])
        index.remove(blocks[5])
        index.flush()
        assert copy.peek([*blocks, b"\x09" * 32]) == [index.is_live(h) for h in blocks] + [False]
        assert len(copy) == len(index) == 3 and copy.is_published()
        scores = [client.zscore(f"{prefix}:exp", h.hex()) for h in blocks[2:5]]
        assert scores == [1015.0, 1015.0, 1010.0]
        copy.peek(blocks)
        assert [client.zscore(f"{prefix}:exp", h.hex()) for h in blocks[2:5]] == scores
        client.delete(f"{prefix}:published")  # Redis lost it
        index.check_published()
        index.flush()
        assert copy.is_published() and copy.peek(blocks[2:5]) == [True, True, True]
    finally:
        for key in client.scan_iter(match=f"{prefix}:*"):
            client.delete(key)
        client.close()


def test_a_node_whose_redis_is_down_serves_its_own_blocks_and_never_raises(clock):
    """A real StoreNode and Peers over a Redis port nobody listens on."""
    from kvstore.redis_index import NodeRegistry
    from services.common.redis_link import RedisHealth, sync_client
    from services.kvstore.peers import Peers

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    registry = NodeRegistry(sync_client(f"redis://127.0.0.1:{port}/0"))
    engines = [TransferEngine(), TransferEngine()]
    node = StoreNode("node-a", NodeLayout(block_bytes=BLOCK, host_capacity_bytes=16 * BLOCK), engines[0],
                     lambda capacity: MirroredIndex(EmbeddedIndex(capacity, clock),
                                                    registry.index_of("node-a", capacity, clock)), clock=clock)
    health = RedisHealth("test", ManualClock())
    peers = Peers(node, registry, health)
    peers.address = "127.0.0.1:1"
    try:
        writer = KVWriter(engines[1])
        assert node.put(HASHES[:4], writer.handle(range(4))).num_stored == 4
        peers.publish()
        assert not health.is_available and health.num_outages == 1
        assert peers.lookup(HASHES[:5]) == [["127.0.0.1:1"]] * 4 + [[]]
        handle = node.acquire(HASHES[:4])
        assert handle is not None and len(handle.blocks) == 4 and node.release(handle.lease_id)
        assert peers.nodes() == [("node-a", "127.0.0.1:1")]
        peers._upkeep()  # skipped (the probe is not due), then a failed probe: neither raises
        health.clock.now += 10
        peers._upkeep()

        async def upkeep_for_a_while():
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(peers.keep_up(every_s=0.01), 0.2)
        asyncio.run(upkeep_for_a_while())
        assert node.index.needs_resync and health.num_outages == 1
    finally:
        node.close()
        for engine in engines:
            engine.close()
        registry.client.close()
