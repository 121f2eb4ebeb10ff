"""A store node's other nodes, through a shared Redis (optional), and the node's own part there.

With Redis, any node answers a lookup for every live node: its own blocks from its own index,
the others' from their published indexes. Redis is a dependency that degrades, never one that
stops the node::

    Redis up     Lookup: own blocks + peers' published blocks; Nodes: the live nodes in Redis;
                 Put: the new blocks are published before the writer hears back
    Redis down   Lookup: own blocks only (peers' are misses: engines ask every node they know
                 anyway); Nodes: the list last read; Put, Acquire: as ever (the index is local)
    back         the upkeep's next probe finds it: the node announces itself again and
                 re-publishes its whole index (what changed meanwhile was never written)

Calls go through one :class:`~services.common.redis_link.RedisHealth`: while Redis is down they
are skipped until the next probe is due, so no RPC waits on a dead Redis; the upkeep loop runs
every UPKEEP_EVERY_S and never ends on a Redis error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import redis

from kvstore.hashing import BlockHash
from kvstore.mirrored_index import MirroredIndex
from kvstore.redis_index import NodeRegistry
from kvstore.store import StoreNode
from services.common.redis_link import RedisHealth, is_outage

logger = logging.getLogger(__name__)

UPKEEP_EVERY_S = 1.0
"""How often a node announces itself, checks that Redis still holds its index, and publishes
the renewals and removals that no Put published yet."""


class Peers:
    """The nodes a lookup answers for: this one, plus every live node of a shared Redis."""

    def __init__(self, node: StoreNode, registry: NodeRegistry | None = None,
                 health: RedisHealth | None = None) -> None:
        self.node = node
        self.registry = registry
        self.health = health or (RedisHealth(f"kvstore node {node.node_id}") if registry is not None else None)
        self.address = ""
        """This node's gRPC address, set once the server is bound."""
        self._others: dict[str, str] = {}
        """The other live nodes (id -> address) as last read from Redis."""

    def lookup(self, hashes: Sequence[BlockHash]) -> list[list[str]]:
        """Per hash, the addresses of the nodes that hold it (this node first)."""
        holders: list[list[str]] = [[self.address] if held else [] for held in self.node.lookup(hashes)]
        if self.registry is None:
            return holders
        try:
            with self.health.guard():
                for node_id, address in self._read_others().items():
                    for i, held in enumerate(self.registry.index_of(node_id).peek(hashes)):
                        if held:
                            holders[i].append(address)
        except redis.RedisError as exc:
            self._unless_outage(exc)  # the peers' blocks are misses meanwhile
        return holders

    def nodes(self) -> list[tuple[str, str]]:
        """(node id, address) of this node, then of every other live node (the last known list
        while Redis is down)."""
        if self.registry is not None:
            try:
                with self.health.guard():
                    self._read_others()
            except redis.RedisError as exc:
                self._unless_outage(exc)
        return [(self.node.node_id, self.address), *sorted(self._others.items())]

    def publish(self) -> None:
        """Write the node index's changes to Redis now (a Put's new blocks, for the peers)."""
        index = self.node.index
        if self.registry is None or not isinstance(index, MirroredIndex) or not index.has_work:
            return
        try:
            with self.health.guard():
                index.flush()
        except redis.RedisError as exc:
            self._unless_outage(exc)  # the index is in doubt: the upkeep re-publishes it all

    async def keep_up(self, every_s: float = UPKEEP_EVERY_S) -> None:
        """Forever: keep this node in the registry (it drops out within the registry's TTL once
        stopped) and its published index true. Redis errors are waited out, never raised."""
        if self.registry is None:
            await asyncio.Event().wait()
        try:
            while True:
                if self.health.is_worth_trying():  # else no thread hop: the probe is not due
                    await asyncio.to_thread(self._upkeep)
                await asyncio.sleep(every_s)
        finally:
            try:
                with self.health.guard():
                    self.registry.withdraw(self.node.node_id)
            except redis.RedisError:
                pass  # its announcement expires by itself

    def _upkeep(self) -> None:
        index = self.node.index
        try:
            with self.health.guard():
                self.registry.announce(self.node.node_id, self.address)
                if isinstance(index, MirroredIndex):
                    index.check_published()
                    index.flush()
        except redis.RedisError as exc:
            self._unless_outage(exc)

    def _read_others(self) -> dict[str, str]:
        self._others = {n: a for n, a in self.registry.live().items() if n != self.node.node_id}
        return self._others

    def _unless_outage(self, error: redis.RedisError) -> None:
        """An outage is logged once by RedisHealth; anything else (a script error, Redis out of
        memory) is logged here, since it will not pass by itself."""
        if not is_outage(error):
            logger.warning("kvstore node %s: Redis refused a call: %s", self.node.node_id, error)
