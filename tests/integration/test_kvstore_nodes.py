"""Store nodes as real processes sharing a real Redis, reached through the engines' client:
a block written through node 1 is hit through node 2, and replicas survive a node's death."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import uuid

import grpc
import numpy as np
import pytest
import redis

from kvstore.hashing import block_hashes, root_hash
from kvstore.transfer import TransferEngine, TransferState
from services.common.server import wait_for_health
from services.common.wire import kv_handle_to_proto
from services.kvstore.client import StoreClient
from services.launcher import free_port
from services.pb import kvstore_pb2, kvstore_pb2_grpc
from tests.factories import BLOCK, KVWriter

HASHES = block_hashes(list(range(16 * 32)), 16, root_hash(model="m", block_size=16, dtype="float32"))


@contextlib.contextmanager
def store_nodes(redis_url: str | None, count: int, prefix: str):
    processes, addresses = [], []
    try:
        for i in range(count):
            port = free_port("127.0.0.1")
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "services.kvstore", "--port", str(port), "--metrics-port", "none",
                 "--node-id", f"{prefix}-{i}", "--host-capacity-mib", "4", "--block-bytes", str(BLOCK),
                 *(["--redis-url", redis_url] if redis_url else [])]))
            addresses.append(f"127.0.0.1:{port}")
        for address in addresses:
            assert asyncio.run(wait_for_health(address, "epd.v1.KVStore", timeout_s=60))
        yield processes, addresses
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


@pytest.fixture
def redis_prefix_free(redis_url):
    """Each test's nodes get fresh ids, and the shared index is emptied afterwards."""
    yield f"node-{uuid.uuid4().hex[:6]}"
    redis.Redis.from_url(redis_url).flushdb()


async def read_all(client: StoreClient, reader: TransferEngine, hashes) -> list[np.ndarray] | None:
    holders = await client.lookup(hashes)
    if len(holders) < len(hashes):
        return None
    lent = await client.acquire(hashes, holders)
    out = [np.zeros(BLOCK, np.uint8) for _ in hashes]
    try:
        for item in lent:
            op = reader.read(item.handle, [out[i] for i in item.indices])
            assert op.wait(10) is TransferState.DONE, op.error
    finally:
        await client.release(lent)
    return out if sum(len(item.indices) for item in lent) == len(hashes) else None


def test_a_block_written_through_node_1_is_hit_through_node_2(redis_url, redis_prefix_free):
    async def scenario(addresses):
        writer_engine, reader = TransferEngine(), TransferEngine()
        writer = KVWriter(writer_engine)
        through_1, through_2 = StoreClient([addresses[0]]), StoreClient([addresses[1]])
        try:
            assert sorted(await through_1.nodes()) == [f"{redis_prefix_free}-0", f"{redis_prefix_free}-1"]
            assert await through_1.put(HASHES[:24], writer.handle(range(24))) == 24
            holders = await through_2.lookup(HASHES[:24])
            assert len(holders) == 24 and {a for h in holders for a in h} == set(addresses)  # both hold some
            got = await read_all(through_2, reader, HASHES[:24])
            assert got is not None and all(np.array_equal(g, writer.block(i)) for i, g in enumerate(got))
            assert await through_2.lookup(HASHES[24:26]) == []
            for address in addresses:  # every lease was released
                async with grpc.aio.insecure_channel(address) as channel:
                    stats = await kvstore_pb2_grpc.KVStoreStub(channel).GetStats(kvstore_pb2.StoreStatsRequest())
                assert stats.num_leases == 0 and stats.num_blocks > 0
        finally:
            await through_1.close()
            await through_2.close()
            writer_engine.close()
            reader.close()

    with store_nodes(redis_url, 2, redis_prefix_free) as (_, addresses):
        asyncio.run(scenario(addresses))


def test_with_two_replicas_killing_a_node_loses_no_hit(redis_url, redis_prefix_free):
    async def scenario(processes, addresses):
        writer_engine, reader = TransferEngine(), TransferEngine()
        writer = KVWriter(writer_engine)
        client = StoreClient(addresses, replicas=2)
        try:
            assert await client.put(HASHES[:20], writer.handle(range(20))) == 40  # every block twice
            processes[0].kill()
            processes[0].wait()
            got = await read_all(client, reader, HASHES[:20])
            assert got is not None and all(np.array_equal(g, writer.block(i)) for i, g in enumerate(got))
        finally:
            await client.close()
            writer_engine.close()
            reader.close()

    with store_nodes(redis_url, 2, redis_prefix_free) as (processes, addresses):
        asyncio.run(scenario(processes, addresses))


def test_bad_requests_get_invalid_argument_with_a_clear_message():
    with store_nodes(None, 1, "alone") as (_, addresses), grpc.insecure_channel(addresses[0]) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        writer_engine = TransferEngine()
        source = KVWriter(writer_engine).handle(range(2))
        cases = [
            (stub.Lookup, kvstore_pb2.LookupRequest(hashes=[b"short"]), "hash 0 has 5 bytes"),
            (stub.Acquire, kvstore_pb2.AcquireRequest(hashes=[HASHES[0], b"x" * 33]), "hash 1 has 33 bytes"),
            (stub.Put, kvstore_pb2.PutRequest(hashes=HASHES[:3], source=kv_handle_to_proto(source)),
             "3 hashes for 2 source blocks"),
            (stub.Put, kvstore_pb2.PutRequest(hashes=HASHES[:2], source=kv_handle_to_proto(source),
                                              request_class="batch"), "unknown request_class 'batch'"),
            (stub.HasWindow, kvstore_pb2.WindowKey(sequence_hash=HASHES[0], window_end=0), "window_end must be > 0"),
        ]
        try:
            for call, request, message in cases:
                with pytest.raises(grpc.RpcError) as caught:
                    call(request, timeout=10)
                assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, caught.value
                assert message in caught.value.details()
            stats = stub.GetStats(kvstore_pb2.StoreStatsRequest(), timeout=10)
            assert stats.num_blocks == 0 and stats.num_leases == 0  # nothing half-done
        finally:
            writer_engine.close()
