"""How an engine instance reaches the KV store: one client over every store node.

    lookup(hashes)            ask every entry node which nodes hold each block
                              (with a shared Redis index one node answers for all)
    acquire(hashes, holders)  pin the hit blocks on their nodes, in parallel; one lease each
    acquire_prefix(hashes)    both (a single node is asked to acquire straight away)
    ... read them one-sided with the transfer engine, then release_soon(lent): the leases
        ride along with the next Acquire to that node, or go in a Release of their own
        once the client has been idle a few milliseconds ...
    put(hashes, source)       each block goes to its ``replicas`` nodes by rendezvous hashing
                              (kvstore/placement.py); the nodes read it from the writer

The store is a cache: a node that fails an RPC is skipped for a while and every error is a
miss or a skipped write, never a failed request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import grpc.aio

from kvstore.hashing import BlockHash
from kvstore.placement import place, rank
from kvstore.transfer.descriptors import KVHandle
from services.common import metrics
from services.common.server import CHANNEL_OPTIONS
from services.common.wire import kv_handle_from_proto, kv_handle_to_proto
from services.pb import kvstore_pb2, kvstore_pb2_grpc

logger = logging.getLogger(__name__)

_DEAD_FOR_S = 1.0
"""How long a node that failed an RPC is skipped; doubled for each further failure in a row
(up to ``_MAX_DEAD_FOR_S``), so a frozen node costs a request its deadline rarely, not always.
Calls in flight together count as one: those sent before the node's last failure was seen
fail for the same cause, and a burst of them must not skip a node for the longest time."""
_MAX_DEAD_FOR_S = 30.0
FAILURES = metrics.counter("epd_kv_store_client_failures", "Store RPCs this instance made that failed (each a "
                           "miss or a skipped write, never a failed request), by method and gRPC status.",
                           ["method", "code"])
_RELEASE_AFTER_S = 0.005
"""How long a finished read's lease waits for an Acquire to the same node to carry it."""


@dataclass(frozen=True)
class Lent:
    """Blocks one node lends: ``handle.blocks[j]`` is block ``indices[j]`` of the lookup."""

    address: str
    handle: KVHandle
    indices: tuple[int, ...]


class StoreClient:
    def __init__(self, addresses: Sequence[str], replicas: int = 1, timeout_s: float = 1.0,
                 refresh_s: float = 2.0, put_timeout_s: float = 30.0) -> None:
        """``timeout_s``: the deadline of lookups, acquires and releases, which sit on a
        request's path (a frozen node must not hold it up for long); ``put_timeout_s``: of
        writes, which run in the background but pin the writer's blocks meanwhile."""
        if not addresses:
            raise ValueError("a store client needs at least one node address")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1 (got {replicas})")
        self.entry_addresses = tuple(addresses)
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.put_timeout_s = put_timeout_s
        self.refresh_s = refresh_s
        self._stubs: dict[str, kvstore_pb2_grpc.KVStoreStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._dead_until: dict[str, float] = {}
        self._num_failures: dict[str, int] = {}  # address -> RPCs failed in a row
        self._failed_at: dict[str, float] = {}  # address -> when its last counted failure was seen
        self._nodes: dict[str, str] = {}  # node id -> address
        self._nodes_at = float("-inf")
        self._releases: set[asyncio.Task] = set()
        self._to_release: dict[str, list[str]] = {}  # address -> lease ids of finished reads

    # ----- reads -------------------------------------------------------------------------------
    async def lookup(self, hashes: Sequence[BlockHash]) -> list[list[str]]:
        """Holders of each block, cut at the first block no live node holds."""
        if not hashes:
            return []
        request = kvstore_pb2.LookupRequest(hashes=list(hashes))
        replies = await asyncio.gather(*(self._call(a, "Lookup", request) for a in self._live(self.entry_addresses)))
        holders: list[list[str]] = [[] for _ in hashes]
        for reply in replies:
            if reply is None:
                continue
            for i, h in enumerate(reply.holders[:len(hashes)]):
                holders[i].extend(a for a in h.node_addresses if a not in holders[i] and self._is_alive(a))
        num_hits = next((i for i, h in enumerate(holders) if not h), len(holders))
        return holders[:num_hits]

    async def acquire(self, hashes: Sequence[BlockHash], holders: Sequence[Sequence[str]]) -> list[Lent]:
        """Pin ``hashes[:len(holders)]`` on their holders (a block another holder of which fails
        is asked of the next); the blocks lent cover a prefix: the caller reads them, then
        releases every lease."""
        lent: list[Lent] = []
        obtained: set[int] = set()
        tried: dict[int, set[str]] = {i: set() for i in range(len(holders))}
        while True:
            wanted: dict[str, list[int]] = {}
            for i, block_holders in enumerate(holders):
                untried = [a for a in block_holders if a not in tried[i] and self._is_alive(a)]
                if i not in obtained and untried:
                    address = rank(hashes[i], untried)[0]  # spreads reads over replicas
                    wanted.setdefault(address, []).append(i)
                    tried[i].add(address)
            if not wanted:
                break
            replies = await asyncio.gather(*(
                self._call(a, "Acquire", kvstore_pb2.AcquireRequest(
                    hashes=[hashes[i] for i in idx], release_lease_ids=self._to_release.pop(a, [])))
                for a, idx in wanted.items()))
            for (address, indices), reply in zip(wanted.items(), replies):
                if reply is not None and reply.HasField("kv"):
                    handle = kv_handle_from_proto(reply.kv)
                    lent.append(Lent(address, handle, tuple(indices[:len(handle.blocks)])))
                    obtained.update(indices[:len(handle.blocks)])
        num_prefix = next((i for i in range(len(holders)) if i not in obtained), len(holders))
        useful, useless = [], []
        for item in lent:
            keep = tuple(i for i in item.indices if i < num_prefix)
            if keep:
                useful.append(Lent(item.address, KVHandle(item.handle.lease_id, item.handle.owner, item.handle.regions,
                                                          item.handle.blocks[:len(keep)]), keep))
            else:
                useless.append(item)
        await self.release(useless)
        return useful

    async def acquire_prefix(self, hashes: Sequence[BlockHash]) -> list[Lent]:
        """Lookup + acquire; with one store node the lookup round trip is skipped (its Acquire
        lends the leading blocks it holds, which is all there is)."""
        if not hashes:
            return []
        nodes = await self.nodes()
        if len(nodes) == 1:
            address = next(iter(nodes.values()))
            return await self.acquire(hashes, [[address]] * len(hashes))
        return await self.acquire(hashes, await self.lookup(hashes))

    async def release(self, lent: Sequence[Lent]) -> None:
        await asyncio.gather(*(self._call(item.address, "Release", kvstore_pb2.StoreReleaseRequest(
            lease_id=item.handle.lease_id)) for item in lent))

    def release_soon(self, lent: Sequence[Lent]) -> None:
        """Release without a round trip of its own when the client is busy (see the module
        docstring); close() releases whatever is left."""
        for item in lent:
            self._to_release.setdefault(item.address, []).append(item.handle.lease_id)
        if lent:
            asyncio.get_running_loop().call_later(_RELEASE_AFTER_S, self._flush_releases)

    def _flush_releases(self) -> None:
        pending, self._to_release = self._to_release, {}
        for address, lease_ids in pending.items():
            task = asyncio.get_running_loop().create_task(self._release_ids(address, lease_ids))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _release_ids(self, address: str, lease_ids: list[str]) -> None:
        await asyncio.gather(*(self._call(address, "Release", kvstore_pb2.StoreReleaseRequest(lease_id=lease_id))
                               for lease_id in lease_ids))

    # ----- writes ------------------------------------------------------------------------------
    async def put(self, hashes: Sequence[BlockHash], source: KVHandle, request_class: str = "chat") -> int:
        """Have the blocks' nodes read and keep them; returns how many node copies were stored
        or renewed. Returns once every node has read (the writer may then free its blocks)."""
        nodes = await self.nodes()
        if not nodes or not hashes:
            return 0
        per_node: dict[str, list[int]] = {}
        node_ids = sorted(nodes)
        for i, block_hash in enumerate(hashes):
            for node_id in place(block_hash, node_ids, min(self.replicas, len(node_ids))):
                per_node.setdefault(nodes[node_id], []).append(i)
        replies = await asyncio.gather(*(
            self._call(address, "Put", kvstore_pb2.PutRequest(
                hashes=[hashes[i] for i in idx], request_class=request_class,
                source=kv_handle_to_proto(KVHandle(source.lease_id, source.owner, source.regions,
                                                   tuple(source.blocks[i] for i in idx)))),
                timeout_s=self.put_timeout_s)
            for address, idx in per_node.items()))
        return sum(r.num_stored + r.num_renewed for r in replies if r is not None)

    async def put_window(self, sequence_hash: bytes, window_end: int, handle: KVHandle) -> bool:
        """Publish where a window's KV can be read (an instance's SWA region) on the node its
        sequence hash places it on; False when no node took it."""
        address = await self._window_node(sequence_hash)
        request = kvstore_pb2.PutWindowRequest(key=kvstore_pb2.WindowKey(sequence_hash=sequence_hash,
                                                                         window_end=window_end),
                                               data=kv_handle_to_proto(handle).SerializeToString())
        return address is not None and await self._call(address, "PutWindow", request) is not None

    async def get_window(self, sequence_hash: bytes, window_end: int) -> KVHandle | None:
        """Where the window's KV can be read, if a live entry says so (a hit renews it)."""
        address = await self._window_node(sequence_hash)
        if address is None:
            return None
        reply = await self._call(address, "GetWindow", kvstore_pb2.WindowKey(sequence_hash=sequence_hash,
                                                                               window_end=window_end))
        if reply is None or not reply.found:
            return None
        return kv_handle_from_proto(kvstore_pb2.KVHandle.FromString(reply.data))

    async def _window_node(self, sequence_hash: bytes) -> str | None:
        nodes = await self.nodes()
        if not nodes:
            return None
        return nodes[place(sequence_hash, sorted(nodes), 1)[0]]

    async def nodes(self) -> dict[str, str]:
        """node id -> address of the live store nodes (refreshed every ``refresh_s``)."""
        if time.monotonic() - self._nodes_at >= self.refresh_s:
            replies = await asyncio.gather(*(self._call(a, "Nodes", kvstore_pb2.NodesRequest())
                                             for a in self._live(self.entry_addresses)))
            nodes = {n.node_id: n.address for r in replies if r is not None for n in r.nodes}
            self._nodes, self._nodes_at = nodes, time.monotonic()
        return {n: a for n, a in self._nodes.items() if self._is_alive(a)}

    async def close(self) -> None:
        self._flush_releases()
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)
        channels, self._channels, self._stubs = self._channels, [], {}
        for channel in channels:
            await channel.close()

    # ----- plumbing ----------------------------------------------------------------------------
    async def _call(self, address: str, method: str, request, timeout_s: float | None = None):
        """One RPC; None (and the node skipped for a while) when it fails."""
        sent_at = time.monotonic()
        try:
            reply = await getattr(self._stub(address), method)(request, timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            FAILURES.labels(method, exc.code().name).inc()
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                logger.warning("KV store %s %s failed: %s %s", address, method, exc.code().name, exc.details())
            elif sent_at >= self._failed_at.get(address, float("-inf")):  # not one of a burst already counted
                now = self._failed_at[address] = time.monotonic()
                num_failures = self._num_failures[address] = self._num_failures.get(address, 0) + 1
                dead_for_s = min(_MAX_DEAD_FOR_S, _DEAD_FOR_S * 2 ** (num_failures - 1))
                self._dead_until[address] = now + dead_for_s
                logger.warning("KV store %s %s failed: %s %s; skipped for %.0f s", address, method,
                               exc.code().name, exc.details(), dead_for_s)
            return None
        self._num_failures.pop(address, None)
        return reply

    def _stub(self, address: str) -> kvstore_pb2_grpc.KVStoreStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[address] = kvstore_pb2_grpc.KVStoreStub(channel)
        return stub

    def _is_alive(self, address: str) -> bool:
        return self._dead_until.get(address, 0.0) <= time.monotonic()

    def _live(self, addresses: Sequence[str]) -> list[str]:
        return [a for a in addresses if self._is_alive(a)]
