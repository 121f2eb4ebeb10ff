"""The KVStore gRPC service: a thin shell over one :class:`~kvstore.store.StoreNode`.

Blocking node work (reads of a writer's blocks, disk reads, Redis calls) runs in threads, off
the event loop; a memory-only node answers lookups and acquires inline, since a thread hop
would cost more than the work. With a shared Redis, :class:`~services.kvstore.peers.Peers` lets
any node answer a lookup for every live node (and degrades to this node's own blocks while
Redis is down).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore.hashing import BlockHash
from kvstore.store import StoreNode
from services.common.errors import InvalidRequestError
from services.common.wire import kv_handle_from_proto, kv_handle_to_proto
from services.kvstore.peers import Peers
from services.pb import kvstore_pb2, kvstore_pb2_grpc

logger = logging.getLogger(__name__)

MAX_HASHES = 1 << 16
"""Blocks one request may name (a 1M-token prompt at 16 tokens per block)."""


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, node: StoreNode, peers: Peers) -> None:
        self.node = node
        self.peers = peers
        self.is_memory_only = not node.layout.disk_dir and peers.registry is None

    async def _run(self, fn, *args):
        return fn(*args) if self.is_memory_only else await asyncio.to_thread(fn, *args)

    async def Lookup(self, request, context):
        holders = await self._run(self.peers.lookup, _hashes(request.hashes))
        return kvstore_pb2.LookupResponse(holders=[kvstore_pb2.Holders(node_addresses=h) for h in holders])

    async def Acquire(self, request, context):
        for lease_id in request.release_lease_ids:
            self.node.release(lease_id)
        handle = await self._run(self.node.acquire, _hashes(request.hashes))
        reply = kvstore_pb2.AcquireResponse()
        if handle is not None:
            reply.kv.CopyFrom(kv_handle_to_proto(handle))
        return reply

    async def Release(self, request, context):
        return kvstore_pb2.StoreReleaseResponse(released=self.node.release(request.lease_id))

    async def Put(self, request, context):
        hashes = _hashes(request.hashes)
        source = kv_handle_from_proto(request.source)
        if len(source.blocks) != len(hashes):
            raise InvalidRequestError(f"{len(hashes)} hashes for {len(source.blocks)} source blocks")
        request_class = request.request_class or "chat"
        if request_class not in ("agent", "chat"):
            raise InvalidRequestError(f"unknown request_class {request_class!r} (agent or chat)")
        try:
            result = await asyncio.to_thread(self._put, hashes, source, request_class)
        except ValueError as exc:  # blocks of another size than this node's
            raise InvalidRequestError(str(exc)) from None
        return kvstore_pb2.PutResponse(num_stored=result.num_stored, num_renewed=result.num_renewed,
                                       num_failed=result.num_failed)

    def _put(self, hashes: list[BlockHash], source, request_class: str):
        result = self.node.put(hashes, source, request_class)
        self.peers.publish()  # the other nodes see the new blocks before the writer hears back
        return result

    async def Nodes(self, request, context):
        nodes = await self._run(self.peers.nodes)
        return kvstore_pb2.NodesResponse(nodes=[kvstore_pb2.StoreNode(node_id=n, address=a) for n, a in nodes])

    async def PutWindow(self, request, context):
        self.node.put_window(*_window(request.key), request.data)
        return kvstore_pb2.PutWindowResponse()

    async def GetWindow(self, request, context):
        data = self.node.get_window(*_window(request))
        return kvstore_pb2.WindowResponse(found=data is not None, data=data or b"")

    async def HasWindow(self, request, context):
        return kvstore_pb2.WindowResponse(found=self.node.has_window(*_window(request)))

    async def GetStats(self, request, context):
        s = self.node.stats()
        return kvstore_pb2.StoreStats(**{f: getattr(s, f) for f in kvstore_pb2.StoreStats.DESCRIPTOR.fields_by_name})


class NodeMetrics:
    """The node's figures for /metrics, read from its stats at scrape time."""

    def __init__(self, node: StoreNode) -> None:
        self.node = node

    def collect(self):
        s = self.node.stats()
        blocks = GaugeMetricFamily("epd_kvstore_blocks", "Blocks held: in the node index, in memory, on disk.",
                                   labels=["tier"])
        for tier, count in (("node", s.num_blocks), ("host", s.num_host_blocks), ("disk", s.num_disk_blocks)):
            blocks.add_metric([tier], count)
        yield blocks
        yield GaugeMetricFamily("epd_kvstore_leases", "Leases on lent blocks not yet released.", value=s.num_leases)
        yield CounterMetricFamily("epd_kvstore_hit_blocks", "Blocks lent by Acquire.", value=s.num_hits)
        yield CounterMetricFamily("epd_kvstore_miss_blocks", "Blocks asked of Acquire and not held.", value=s.num_misses)
        yield CounterMetricFamily("epd_kvstore_corrupt_blocks", "Blocks dropped: their data failed a checksum.",
                                  value=s.num_corrupt)
        yield CounterMetricFamily("epd_kvstore_index_resyncs", "Times the node published its whole index to "
                                  "Redis (at start, and after Redis was down or lost it).",
                                  value=getattr(self.node.index, "num_resyncs", 0))


def _hashes(raw: Sequence[bytes]) -> list[BlockHash]:
    if len(raw) > MAX_HASHES:
        raise InvalidRequestError(f"{len(raw)} hashes in one request; at most {MAX_HASHES}")
    for i, h in enumerate(raw):
        if len(h) != 32:
            raise InvalidRequestError(f"hash {i} has {len(h)} bytes; block hashes are 32 bytes")
    return [BlockHash(bytes(h)) for h in raw]


def _window(key) -> tuple[bytes, int]:
    if len(key.sequence_hash) != 32:
        raise InvalidRequestError(f"a window's sequence hash is 32 bytes, not {len(key.sequence_hash)}")
    if key.window_end <= 0:
        raise InvalidRequestError(f"window_end must be > 0 (got {key.window_end})")
    return bytes(key.sequence_hash), key.window_end


def add_to_server(server, node: StoreNode, peers: Peers) -> None:
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(KVStoreServicer(node, peers), server)
