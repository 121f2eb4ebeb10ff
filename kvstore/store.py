"""One KV store node: block KV by chained hash in host memory and on local disk, lent one-sided.

Life cycle of a block on a node::

    Put(hashes, source handle) --> take staging slots --> read the writer's blocks one-sided
        --> commit: node index (TTL by request class) + host tier + disk queue (written off
            the request's path) --> the writer frees its copy
    Acquire(hashes) --> leading blocks the index holds --> a disk-only block is read back
        into a host slot (a failed checksum drops it: a miss) --> slots pinned under a lease
        --> KVHandle --> the engine reads one-sided --> Release (or lease expiry) unpins

Three indexes, one job each: the *node index* (embedded; with a shared Redis also published
under this node's namespace there for the other nodes, ``mirrored_index.py``) says what the
node holds and for how long, and evicts expired-first then LRU at the node's capacity; the host
tier's and the disk tier's own indexes only decide which blocks stay in memory and which
records live on disk. A block the node index evicts leaves both tiers.

Torch-free and gRPC-free: ``services/kvstore`` serves it; tests drive it directly.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.hashing import BlockHash
from kvstore.index import BlockIndex, Clock, EmbeddedIndex
from kvstore.retention import Retention
from kvstore.swa import DEFAULT_SWA_TTL_S, SWAPool
from kvstore.tiers import DiskTier, HostTier
from kvstore.transfer.checksum import checksum
from kvstore.transfer.descriptors import BlockDesc, KVHandle, LeaseId
from kvstore.transfer.engine import TransferEngine
from kvstore.transfer.leases import LeaseTable
from kvstore.transfer.state import TransferState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PutResult:
    num_stored: int = 0
    num_renewed: int = 0
    num_failed: int = 0


@dataclass(frozen=True)
class NodeStats:
    node_id: str
    num_blocks: int
    num_host_blocks: int
    num_disk_blocks: int
    host_capacity_blocks: int
    disk_capacity_blocks: int
    num_leases: int
    num_windows: int
    num_hits: int
    num_misses: int
    num_corrupt: int
    block_bytes: int


@dataclass(frozen=True)
class NodeLayout:
    """How big a node is; the block size comes from the first Put when ``block_bytes`` is 0."""

    block_bytes: int = 0
    host_capacity_bytes: int = 1 << 30
    disk_dir: str = ""
    """Directory of the disk tier's segment files; "" keeps blocks in memory only."""
    disk_capacity_bytes: int = 16 << 30
    swa_capacity_entries: int = 4096
    swa_ttl_s: float = DEFAULT_SWA_TTL_S
    lease_ttl_s: float = 30.0


class StoreNode:
    def __init__(self, node_id: str, layout: NodeLayout, transfer: TransferEngine,
                 make_index: Callable[[int], BlockIndex] | None = None, retention: Retention = Retention(),
                 clock: Clock = time.time) -> None:
        """``make_index(capacity_blocks)`` builds the node index (default: embedded); the
        caller owns ``transfer``."""
        self.node_id = node_id
        self.layout = layout
        self.transfer = transfer
        self.retention = retention
        self.clock = clock
        self._make_index = make_index or (lambda capacity: EmbeddedIndex(capacity, clock))
        self.index: BlockIndex | None = None
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        self.swa = SWAPool(layout.swa_capacity_entries, layout.swa_ttl_s, clock)
        self.leases = LeaseTable(ttl_s=layout.lease_ttl_s)
        self._checksums: dict[BlockHash, int] = {}
        self._lock = threading.RLock()
        self._allocating = threading.Lock()  # held while the tiers are made; not by lookups
        self.num_hits = self.num_misses = 0
        block_bytes = layout.block_bytes or self._block_bytes_on_disk()
        if block_bytes:
            self._allocate(block_bytes)

    # ----- lookups and lending -------------------------------------------------------------
    def lookup(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Which of ``hashes`` this node holds (each on its own); renews those."""
        with self._lock:
            if self.index is None:
                return [False] * len(hashes)
            held = self.index.present(hashes)
            for block_hash, is_held in zip(hashes, held):
                if is_held:
                    self._renew_tiers(block_hash)
            return held

    def acquire(self, hashes: Sequence[BlockHash]) -> KVHandle | None:
        """Pin the leading held blocks of ``hashes`` under a new lease; None when the first is a miss."""
        with self._lock:
            if self.index is None:
                self.num_misses += len(hashes)
                return None
            slots = []
            for block_hash in hashes[:self.index.lookup(hashes)]:
                slot = self._host_slot(block_hash)
                if slot is None:
                    break
                self.host.pin(slot)
                slots.append((block_hash, slot))
            self.num_hits += len(slots)
            self.num_misses += len(hashes) - len(slots)
            if not slots:
                return None
            lease_id = self.leases.grant(lambda: self._unpin([s for _, s in slots]))
            size, region = self.host.block_bytes, self.host.region
            blocks = tuple(BlockDesc(region.region_id, slot * size, size, self._checksums[h]) for h, slot in slots)
            return KVHandle(LeaseId(lease_id), self.transfer.endpoint, (region.desc,), blocks)

    def release(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

    def expire_leases(self) -> list[LeaseId]:
        return self.leases.expire()

    # ----- writes --------------------------------------------------------------------------
    def put(self, hashes: Sequence[BlockHash], source: KVHandle, request_class: str = "chat",
            timeout_s: float = 60.0) -> PutResult:
        """Read the blocks this node lacks from the writer, one-sided, and keep them. Blocking."""
        if len(hashes) != len(source.blocks):
            raise ValueError(f"{len(hashes)} hashes for {len(source.blocks)} blocks")
        ttl_s = self.retention.ttl_s(request_class)
        if not hashes:
            return PutResult()
        if self.host is None:
            self._allocate(source.blocks[0].length)
        with self._lock:
            if any(b.length != self.host.block_bytes for b in source.blocks):
                raise ValueError(f"blocks of this node are {self.host.block_bytes} bytes")
            is_held = self.index.present(hashes)
            wanted, num_renewed = [], 0
            for i, (block_hash, held) in enumerate(zip(hashes, is_held)):
                if held:
                    self._insert(block_hash, ttl_s)  # the longer class wins; tiers renew too
                    num_renewed += 1
                elif (slot := self.host.take_slot()) is not None:
                    wanted.append((i, block_hash, slot))
        num_failed = len(hashes) - num_renewed - len(wanted)
        if not wanted:
            return PutResult(0, num_renewed, num_failed)
        handle = KVHandle(source.lease_id, source.owner, source.regions,
                          tuple(source.blocks[i] for i, _, _ in wanted))
        op = self.transfer.read(handle, [self.host.block(slot) for _, _, slot in wanted])
        state = op.wait(timeout_s)
        if state is not TransferState.DONE:
            if not state.is_final:
                op.cancel()
                op.wait()
            logger.warning("put of %d blocks failed: %s", len(wanted), op.error or "timed out")
            with self._lock:
                for _, _, slot in wanted:
                    self.host.abandon(slot)
            return PutResult(0, num_renewed, num_failed + len(wanted))
        with self._lock:
            for i, block_hash, slot in wanted:
                self._checksums[block_hash] = source.blocks[i].checksum
                self.host.commit(block_hash, slot, ttl_s)
                self._insert(block_hash, ttl_s)
                if self.disk is not None:
                    self.disk.put(block_hash, self.host.block(slot), ttl_s)
        return PutResult(len(wanted), num_renewed, num_failed)

    # ----- the SWA tier ----------------------------------------------------------------------
    def put_window(self, sequence_hash: bytes, window_end: int, data: bytes) -> None:
        with self._lock:
            self.swa.put(sequence_hash, window_end, data)

    def get_window(self, sequence_hash: bytes, window_end: int) -> bytes | None:
        with self._lock:
            return self.swa.get(sequence_hash, window_end)

    def has_window(self, sequence_hash: bytes, window_end: int) -> bool:
        with self._lock:
            return self.swa.lookup(sequence_hash, window_end)

    # ----- state -------------------------------------------------------------------------------
    def stats(self) -> NodeStats:
        with self._lock:
            return NodeStats(
                node_id=self.node_id, num_blocks=len(self.index) if self.index is not None else 0,
                num_host_blocks=len(self.host) if self.host is not None else 0,
                num_disk_blocks=len(self.disk) if self.disk is not None else 0,
                host_capacity_blocks=self.host.capacity_blocks if self.host is not None else 0,
                disk_capacity_blocks=self.disk.index.capacity_blocks if self.disk is not None else 0,
                num_leases=len(self.leases), num_windows=len(self.swa), num_hits=self.num_hits,
                num_misses=self.num_misses,
                num_corrupt=self.disk.num_corrupt if self.disk is not None else 0,
                block_bytes=self.host.block_bytes if self.host is not None else 0)

    def flush(self) -> None:
        """Wait until every queued disk write is on disk (tests, shutdown)."""
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        self.leases.release_all()
        if self.disk is not None:
            self.disk.close()
        if self.host is not None:
            self.transfer.unregister(self.host.region.region_id)
            self.host.close()

    # ----- internals ---------------------------------------------------------------------------
    def _allocate(self, block_bytes: int) -> None:
        """Size the tiers for this block size, pre-touch the host pool, rebuild from disk. Only
        the rebuild holds the node's lock: a pool of gigabytes takes seconds to touch on a busy
        machine, and lookups meanwhile answer misses at once instead of missing their deadlines."""
        with self._allocating:
            if self.host is not None:  # another Put made them meanwhile
                return
            layout = self.layout
            host_blocks = max(1, layout.host_capacity_bytes // block_bytes)
            region_id = f"{self.node_id}-store-{uuid.uuid4().hex[:6]}"
            host = HostTier(block_bytes, host_blocks, self.clock, region_id=region_id)
            self.transfer.register(host.region)
            capacity, disk = host_blocks, None
            if layout.disk_dir:
                disk_blocks = max(1, layout.disk_capacity_bytes // block_bytes)
                disk = DiskTier(Path(layout.disk_dir) / f"block-{block_bytes}", block_bytes, disk_blocks, self.clock)
                capacity = max(disk_blocks, host_blocks)
            index = self._make_index(capacity)
            index.clear()  # a shared index may remember what this node held before it restarted
            with self._lock:
                self.disk, self.index, self.host = disk, index, host
                if self.disk is not None:
                    for block_hash, expires_at, ttl_s in self.disk.entries():
                        for gone in self.index.insert(block_hash, ttl_s, expires_at):
                            self._drop(gone)
        logger.info("store node %s: %d host slots, %s, %d blocks rebuilt from disk", self.node_id, host_blocks,
                    f"disk tier in {layout.disk_dir}" if self.disk is not None else "no disk tier", len(self.index))

    def _block_bytes_on_disk(self) -> int:
        """The block size of the newest disk tier a previous run left (0: none), so a node
        restarted without --block-bytes serves its disk hits at once."""
        if not self.layout.disk_dir:
            return 0
        tiers = sorted(Path(self.layout.disk_dir).glob("block-*"), key=lambda p: p.stat().st_mtime)
        return int(tiers[-1].name.removeprefix("block-")) if tiers else 0

    def _insert(self, block_hash: BlockHash, ttl_s: float) -> None:
        for gone in self.index.insert(block_hash, ttl_s):
            self._drop(gone)
        self._renew_tiers(block_hash)

    def _renew_tiers(self, block_hash: BlockHash) -> None:
        """A use the node index saw is a use for the tiers too (their LRU, their TTL)."""
        self.host.index.lookup([block_hash])
        if self.disk is not None:
            self.disk.lookup([block_hash])

    def _host_slot(self, block_hash: BlockHash) -> int | None:
        """The block's host slot, reading it back from disk if it is only there; None: lost."""
        slot = self.host.slot_of(block_hash)
        if slot is not None:
            self._renew_tiers(block_hash)
            return slot
        data = self.disk.get(block_hash) if self.disk is not None else None
        if data is not None:
            self.disk.lookup([block_hash])
            slot = self.host.put(block_hash, data, self.retention.ttl_s("chat"))
            if slot is not None:
                self._checksums[block_hash] = checksum(data)
                return slot
            return None  # no spare slot right now: a miss, the block stays on disk
        self.index.remove(block_hash)  # gone from both tiers (evicted there, or corrupt)
        self._checksums.pop(block_hash, None)
        return None

    def _drop(self, block_hash: BlockHash) -> None:
        self.host.remove(block_hash)
        if self.disk is not None:
            self.disk.remove(block_hash)
        self._checksums.pop(block_hash, None)

    def _unpin(self, slots: list[int]) -> None:
        with self._lock:
            for slot in slots:
                self.host.unpin(slot)
