"""KV store node settings: every field a --flag and an EPD_KVSTORE_* variable."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.retention import Retention
from kvstore.transfer.engine import TRANSPORT_CHOICES
from kvstore.store import NodeLayout
from services.common.config import check
from services.common.server import ServerOptions


@dataclass(frozen=True)
class KVStoreConfig(ServerOptions):
    """One KV store node: block KV by hash in host memory and on local disk, lent one-sided."""

    port: int = 50081
    """gRPC port; 0 picks a free one."""
    node_id: str = ""
    """The node's name in placement and in a shared index; empty: kvstore-<port>. Keep it
    stable across restarts (a shared index and the block placement follow it)."""
    advertise_host: str = ""
    """Host name engines use to reach this node (gRPC and data); empty: the bind host."""
    transfer_port: int = 0
    """TCP port of the data server engines on other hosts read from; 0 picks a free one."""
    kv_transport: str = "auto"
    """How this node reads the blocks engines write: auto (shared memory on one host, TCP across
    hosts), or one transport always: shm, tcp, or nixl (NIXL over UCX, where installed)."""
    block_bytes: int = 0
    """Bytes of one KV block (all engines of one model agree); 0: learnt from the first Put,
    when the host pool is allocated."""
    host_capacity_mib: int = 1024
    """Host-memory tier size, allocated and pre-touched up front."""
    disk_dir: str = ""
    """Directory of the disk tier's segment files (kept across restarts); empty: no disk tier."""
    disk_capacity_gib: float = 16.0
    """Disk tier size; with a disk tier the node holds this much, hot blocks also in memory."""
    redis_url: str = ""
    """A Redis that several store nodes (and routers) share for their block indexes and node
    list; empty: this node's index lives in its own memory."""
    agent_ttl_s: float = Retention.agent_ttl_s
    """How long blocks of agent traffic live (renewed on every hit)."""
    chat_ttl_s: float = Retention.chat_ttl_s
    """How long blocks of chat traffic live (renewed on every hit)."""
    swa_ttl_s: float = NodeLayout.swa_ttl_s
    """How long sliding-window KV lives in the SWA tier."""
    swa_capacity_entries: int = NodeLayout.swa_capacity_entries
    """Windows the SWA tier holds."""
    lease_ttl_s: float = NodeLayout.lease_ttl_s
    """How long lent blocks stay pinned for an engine that has not released them."""

    def __post_init__(self) -> None:
        ServerOptions.__post_init__(self)
        check(self.block_bytes >= 0, "block_bytes", "must be >= 0 (0: learnt from the first Put)")
        check(self.kv_transport in TRANSPORT_CHOICES, "kv_transport", f"must be one of {', '.join(TRANSPORT_CHOICES)}")
        check(self.host_capacity_mib > 0, "host_capacity_mib", "must be > 0")
        check(self.disk_capacity_gib > 0, "disk_capacity_gib", "must be > 0")
        for name in ("agent_ttl_s", "chat_ttl_s", "swa_ttl_s", "lease_ttl_s"):
            check(getattr(self, name) > 0, name, "must be > 0")
        check(self.swa_capacity_entries > 0, "swa_capacity_entries", "must be > 0")
        check(0 <= self.transfer_port <= 65535, "transfer_port", "must be in 0..65535 (0: a free port)")

    def layout(self) -> NodeLayout:
        return NodeLayout(block_bytes=self.block_bytes, host_capacity_bytes=self.host_capacity_mib << 20,
                          disk_dir=self.disk_dir, disk_capacity_bytes=int(self.disk_capacity_gib * 2**30),
                          swa_capacity_entries=self.swa_capacity_entries, swa_ttl_s=self.swa_ttl_s,
                          lease_ttl_s=self.lease_ttl_s)

    def retention(self) -> Retention:
        return Retention(agent_ttl_s=self.agent_ttl_s, chat_ttl_s=self.chat_ttl_s)
