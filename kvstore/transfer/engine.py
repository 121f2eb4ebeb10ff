"""``TransferEngine``: one per instance; registers its KV pool, exports handles, reads peers' KV.

    prefill instance                                   decode instance
    engine.register(pool_region)                       engine.register(pool_region)
    handle = engine.export(region_id, ranges, lease)   op = engine.read(handle, dest_blocks)
           --- handle travels in the gRPC reply --->   op.poll() ... DONE -> blocks are usable

The data never goes through gRPC: a same-host reader maps the owner's /dev/shm region (shm),
any other reader pulls from the owner's data server thread (tcp).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from typing import Iterable, Sequence

from kvstore.transfer.base import Transport, TransportOptions
from kvstore.transfer.checksum import checksum
from kvstore.transfer.descriptors import BlockDesc, Endpoint, HostId, KVHandle, LeaseId, RegionId
from kvstore.transfer.memory import MemoryRegion
from kvstore.transfer.registry import load_transport
from kvstore.transfer.state import TransferOp

log = logging.getLogger(__name__)


HOST_ID_ENV = "EPD_HOST_ID"
"""Overrides the machine's id: processes that share a machine but should move KV as if they
did not (several Ray "nodes" on one host, a test acting as another machine) set it."""


def local_host_id() -> HostId:
    """Same value for every process on this machine (and container: the hostname differs),
    unless ``EPD_HOST_ID`` says otherwise."""
    if override := os.environ.get(HOST_ID_ENV, ""):
        return HostId(override)
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return HostId(hashlib.sha256(f"{boot_id}|{socket.gethostname()}".encode()).hexdigest()[:16])


def _nixl_installed() -> bool:
    import importlib.util  # find_spec, not import: nixl pulls torch and takes a second
    return importlib.util.find_spec("nixl") is not None


TRANSPORT_CHOICES: dict[str, tuple[str, ...]] = {
    "auto": ("shm", "tcp"), "shm": ("shm",), "tcp": ("tcp",),
    **({"nixl": ("nixl",)} if _nixl_installed() else {}),
}
"""What a service's ``--kv-transport`` enables, in order of preference: ``auto`` reads a peer on
the same host through shared memory and others over TCP; each other choice forces that one
transport (``tcp`` is what hosts apart do; the tests force it to run that path on one machine),
``nixl`` only where it is installed. ``auto`` leaves NIXL out for now: it has run only on one
host here (UCX over CMA), every process that loads it starts an agent with a progress thread,
and a process that also loads grpc_tools' protoc crashes (NIXL bundles its own gRPC / protobuf;
the stubs' freshness test runs protoc in a process of its own for that reason). Once it has run
between hosts: ``("shm", "nixl", "tcp") if _nixl_installed() else ("shm", "tcp")``."""
OPTIONAL_TRANSPORTS = frozenset({"nixl"})
"""Left out, with a warning, when they fail to start among others; fatal when forced alone."""


class TransferEngine:
    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 transports: Sequence[str] = ("shm", "tcp"), *, advertise_host: str = "",
                 num_workers: int = 2, num_copy_threads: int = 0, timeout_s: float = 10.0,
                 host_id: str | None = None):
        """``transports`` is also the order of preference when picking one for a read;
        ``host_id`` overrides the machine id (tests use it to act as another host)."""
        self.host_id = HostId(host_id or local_host_id())
        options = TransportOptions(host_id=self.host_id, host=host, port=port, advertise_host=advertise_host,
                                   num_workers=num_workers, num_copy_threads=num_copy_threads,
                                   timeout_s=timeout_s)
        self._transports: dict[str, Transport] = {}
        try:
            for name in transports:
                try:
                    self._transports[name] = load_transport(name)(options)
                except Exception as exc:
                    if name not in OPTIONAL_TRANSPORTS or len(transports) == 1:
                        raise
                    log.warning("kv transport %s unavailable, going on without it: %s", name, exc)
        except BaseException:
            self.close()
            raise
        self._regions: dict[RegionId, MemoryRegion] = {}
        self.endpoint = self._endpoint()

    def _endpoint(self) -> Endpoint:
        """Where peers read us; NIXL's part names the registered regions, so it follows them."""
        return Endpoint(self.host_id, getattr(self._transports.get("tcp"), "address", ""),
                        getattr(self._transports.get("nixl"), "info", ""))

    def register(self, region: MemoryRegion) -> None:
        if region.region_id in self._regions:
            raise ValueError(f"region {region.region_id} is already registered")
        self._regions[region.region_id] = region
        for transport in self._transports.values():
            transport.register(region)
        self.endpoint = self._endpoint()

    def unregister(self, region_id: str) -> None:
        """Peers' reads of this region fail from now on (the region itself stays open)."""
        for transport in self._transports.values():
            transport.unregister(RegionId(region_id))
        self._regions.pop(RegionId(region_id), None)
        self.endpoint = self._endpoint()

    def export(self, region_id: str, offsets_and_lengths: Iterable[tuple[int, int]],
               lease_id: str) -> KVHandle:
        """A handle naming these byte ranges of a registered region, checksummed now.

        The caller keeps the blocks unmodified until the lease ends (``LeaseTable``).
        """
        region = self._regions.get(RegionId(region_id))
        if region is None:
            raise ValueError(f"region {region_id} is not registered")
        buffer = region.buffer
        blocks = []
        for offset, length in offsets_and_lengths:
            if offset < 0 or length <= 0 or offset + length > region.length:
                raise ValueError(f"range [{offset}, +{length}) is outside region {region_id} "
                                 f"({region.length} bytes)")
            blocks.append(BlockDesc(region.region_id, offset, length, checksum(buffer[offset:offset + length])))
        return KVHandle(LeaseId(lease_id), self.endpoint, (region.desc,), tuple(blocks))

    def select_transport(self, handle: KVHandle) -> str | None:
        """The first of our transports (in preference order) that can reach the handle's owner."""
        return next((name for name, t in self._transports.items() if t.can_read(handle)), None)

    def read(self, handle: KVHandle, destinations: Sequence, transport: str | None = None) -> TransferOp:
        """Copy ``handle.blocks[i]`` into ``destinations[i]`` (writable, contiguous, exactly the
        block's length) off this thread; poll the op. ``transport`` overrides the automatic pick."""
        if transport is not None and transport not in self._transports:
            raise ValueError(f"transport {transport!r} is not enabled here ({', '.join(self._transports)})")
        name = transport or self.select_transport(handle)
        if name is None:
            return TransferOp.failed(f"no transport among {', '.join(self._transports)} can reach "
                                     f"owner {handle.owner}")
        return self._transports[name].read(handle, destinations)

    def close(self) -> None:
        """Stop data servers and workers. Idempotent. Registered regions stay open (the caller owns them)."""
        transports, self._transports = self._transports, {}
        for transport in transports.values():
            transport.close()
        self._regions = {}

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
