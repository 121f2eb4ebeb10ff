"""NIXL transport: one-sided READs through a NIXL agent's UCX backend.

UCX picks the path: RDMA, CUDA IPC or GPUDirect between real cluster nodes; shared memory / CMA
or TCP on a plain host. Export and read::

    owner                                              reader
    register(region) -> agent.register_memory          add_remote_agent(metadata)   (cached per
    endpoint.nixl = {agent, metadata, region bases}    READ (base + offset, length)   metadata)
           --- travels in the KVHandle --->            poll until DONE, checksum every block

The owner's engine loop does nothing per read. ``Endpoint.nixl`` is a JSON string (the agent's
serialized metadata base64'd), rebuilt whenever a region is (un)registered, because the metadata
names the registered memory. Destinations inside a region registered here go straight to
NIXL; any other buffer is registered for the one read.

Unregistering deregisters the memory from NIXL and drops it from new handles; over RDMA that
revokes the remote key, over CMA (one host) the bytes stay readable: the lease protects them,
as with shm. Only host regions today (``MemoryRegion`` is host memory); a device pool would
register as "VRAM" the same way and skip the host checksum.

Loading NIXL loads its bundled gRPC / protobuf / etcd libraries: fine beside grpcio, fatal in a
process that also loads grpc_tools' protoc (either order). ``auto`` leaves it out for now
(``engine.TRANSPORT_CHOICES`` says why); ``--kv-transport nixl`` forces it.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
import uuid
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvstore.transfer.base import (
    Transport, TransportOptions, TransferError, check_destinations, mismatch, start_read)
from kvstore.transfer.checksum import CHUNK_BYTES, chunk_sums, combine
from kvstore.transfer.descriptors import KVHandle, RegionId
from kvstore.transfer.memory import MemoryRegion
from kvstore.transfer.state import TransferOp

log = logging.getLogger(__name__)

PROGRESS_DELAY_US = 1000
"""Sleep of the agent's progress thread between passes. The owner needs it (UCX connection
wire-up, and AM-emulated reads over TCP); the nixl wrapper hard-codes 0, a busy loop that took
a whole core here while idle. 1 ms: ~2% of a core idle; the reader progresses its own reads."""
MAX_INFO_CHARS = 1 << 20
"""Longest ``Endpoint.nixl`` a reader parses (rule 17): metadata is ~0.5 KiB per region."""
GROUP_BYTES = 8 << 20
"""Bytes of blocks per NIXL request. Against raw NIXL (one request for all blocks, no checksum),
64 MiB of 720 KiB blocks, 2 shared cores: one block per request ~0.65, 4 blocks ~0.75, 8-16
blocks (6-12 MiB) ~0.83, all in one request (no read to overlap the sums with) ~0.6; in
benchmarks/kv_transfer.py this setting gives nixl_vs_raw 0.80-0.81. The sums, not the requests,
cost: without them one request per block is within 2% of raw."""
PIECE_BYTES = 256 << 10
assert PIECE_BYTES % CHUNK_BYTES == 0, "pieces must start on checksum chunk boundaries"
SPIN_POLLS = 10_000
"""Status polls before the wait starts sleeping: a 64 MiB host read finishes within them."""

_config_lock = threading.Lock()


def make_agent(name: str):
    """A UCX ``nixl_agent`` whose progress thread sleeps PROGRESS_DELAY_US between passes."""
    import nixl._api as api  # torch comes with it: loaded only when this transport is

    # nixl logs INFO to stdout (its own handler) per agent and backend: keep stdout for us.
    logging.getLogger("nixl").setLevel(logging.WARNING)

    bind = api.nixlBind
    base = bind.nixlAgentConfig

    class Config(base):  # the wrapper sets pthrDelay = 0; keep ours
        @property
        def pthrDelay(self):  # noqa: N802 - the binding's name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _value):  # noqa: N802
            base.pthrDelay.__set__(self, PROGRESS_DELAY_US)

    config = api.nixl_agent_config(backends=["UCX"],
                                   sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    with _config_lock:
        bind.nixlAgentConfig = Config
        try:
            agent = api.nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = base
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL has no UCX backend here")
    return agent


@dataclass(frozen=True)
class PeerInfo:
    """What ``Endpoint.nixl`` carries: the owner's agent and where its regions start."""
    agent: str
    metadata: bytes
    regions: dict[str, tuple[int, int]]
    """region id -> (base address in the owner, length)."""

    def encode(self) -> str:
        return json.dumps({"agent": self.agent, "metadata": base64.b64encode(self.metadata).decode(),
                           "regions": {k: list(v) for k, v in self.regions.items()}})

    @classmethod
    def decode(cls, text: str) -> PeerInfo | None:
        """None when absent or malformed (the transport then cannot reach that owner)."""
        if not text or len(text) > MAX_INFO_CHARS:
            return None
        try:
            d = json.loads(text)
            regions = {str(k): (int(v[0]), int(v[1])) for k, v in d["regions"].items()}
            return cls(str(d["agent"]), base64.b64decode(d["metadata"], validate=True), regions)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return None


class NixlTransport(Transport):
    name = "nixl"

    def __init__(self, options: TransportOptions):
        self._options = options
        self._agent = make_agent(f"epd-{options.host_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._executor = ThreadPoolExecutor(options.num_workers, thread_name_prefix="epd-nixl")
        self._summer = ThreadPoolExecutor(1, thread_name_prefix="epd-nixl-sum")
        self._lock = threading.Lock()
        self._registered: dict[RegionId, tuple[object, int, int]] = {}
        """region id -> (NIXL registration, base address, length)."""
        self._peers: dict[str, bytes] = {}
        """remote agent name -> the metadata it was loaded with."""
        self.info = ""
        """``Endpoint.nixl`` for handles exported from now on."""
        self._is_closed = False

    def register(self, region: MemoryRegion) -> None:
        base, length = region.buffer.ctypes.data, region.length
        with self._lock:
            descs = self._agent.register_memory([(base, length, 0, "")], "DRAM")
            self._registered[region.region_id] = (descs, base, length)
            self._refresh_info()

    def unregister(self, region_id: RegionId) -> None:
        with self._lock:
            entry = self._registered.pop(region_id, None)
            if entry is not None:
                self._agent.deregister_memory(entry[0])
                self._refresh_info()

    def can_read(self, handle: KVHandle) -> bool:
        info = PeerInfo.decode(getattr(handle.owner, "nixl", ""))
        return info is not None and all(b.region_id in info.regions for b in handle.blocks)

    def read(self, handle: KVHandle, destinations: Sequence) -> TransferOp:
        views = check_destinations(handle, destinations)
        return start_read(self._executor, handle, lambda op: self._read(handle, views, op))

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._summer.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            for descs, _, _ in self._registered.values():
                self._agent.deregister_memory(descs)
            self._registered.clear()
            for name in self._peers:
                self._agent.remove_remote_agent(name)
            self._peers.clear()
        self._agent = None  # the agent's destructor stops its threads

    def _refresh_info(self) -> None:
        regions = {rid: (base, length) for rid, (_, base, length) in self._registered.items()}
        self.info = PeerInfo(self._agent.name, self._agent.get_agent_metadata(), regions).encode()

    # ------------------------------------------------------------------ reader side

    def _read(self, handle: KVHandle, views: list[memoryview], op: TransferOp) -> None:
        info = PeerInfo.decode(getattr(handle.owner, "nixl", ""))
        if info is None:
            raise TransferError("the handle carries no NIXL endpoint")
        remote = []
        for i, block in enumerate(handle.blocks):
            if block.region_id not in info.regions:
                raise TransferError(f"block {i}: region {block.region_id} is not exported over NIXL")
            base, length = info.regions[block.region_id]
            if block.offset + block.length > length:
                raise TransferError(f"block {i} [{block.offset}, +{block.length}) is outside region "
                                    f"{block.region_id} ({length} bytes)")
            remote.append((base + block.offset, block.length, 0))
        arrays = [np.frombuffer(view, dtype=np.uint8) for view in views]
        local = [(a.ctypes.data, a.nbytes, 0) for a in arrays]
        peer = self._connect(info)
        temporary = self._register_outside(local)
        try:
            # One request per group of blocks; the summing thread checks a group while this
            # thread reads the next (UCX's CMA copy runs inside the post call, GIL released).
            checks = []
            try:
                for start, end in _groups(handle):
                    if op.is_cancelled:
                        raise TransferError("cancelled")
                    self._transfer(local[start:end], remote[start:end], peer, op)
                    checks.append(self._summer.submit(self._check, handle, arrays, start, end, op))
            finally:
                # Every check ends before the op does; the first mismatch is the op's error.
                futures.wait(checks)
            for check in checks:
                check.result()
        finally:
            if temporary is not None:
                with self._lock:
                    self._agent.deregister_memory(temporary)

    @staticmethod
    def _check(handle: KVHandle, arrays: list[np.ndarray], start: int, end: int, op: TransferOp) -> None:
        for i in range(start, end):
            if op.is_cancelled:
                return
            block, dest = handle.blocks[i], arrays[i]
            sums = [chunk_sums(dest[at:at + PIECE_BYTES]) for at in range(0, block.length, PIECE_BYTES)]
            actual = combine(sums[0] if len(sums) == 1 else np.concatenate(sums), block.length)
            if actual != block.checksum:
                raise mismatch(i, block.region_id, block.checksum, actual)

    def _connect(self, info: PeerInfo) -> str:
        with self._lock:
            if self._peers.get(info.agent) != info.metadata:
                try:
                    if info.agent in self._peers:  # re-registered regions: fresh metadata
                        self._agent.remove_remote_agent(info.agent)
                        del self._peers[info.agent]
                    name = self._agent.add_remote_agent(info.metadata)
                except Exception as exc:  # nixl raises its own error types
                    raise TransferError(f"cannot load NIXL agent {info.agent}: {exc}") from None
                name = name.decode() if isinstance(name, bytes) else name
                if name != info.agent:
                    self._agent.remove_remote_agent(name)
                    raise TransferError(f"metadata names agent {name}, handle says {info.agent}")
                self._peers[info.agent] = info.metadata
        return info.agent

    def _register_outside(self, local: list[tuple[int, int, int]]):
        """Register the destinations that lie in no registered region, for this read only."""
        with self._lock:
            spans = [(base, base + length) for _, base, length in self._registered.values()]
            outside = [(addr, n, 0, "") for addr, n, _ in local
                       if not any(lo <= addr and addr + n <= hi for lo, hi in spans)]
            return self._agent.register_memory(outside, "DRAM") if outside else None

    def _transfer(self, local, remote, peer: str, op: TransferOp) -> None:
        agent = self._agent
        try:
            xfer = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                         agent.get_xfer_descs(remote, "DRAM"), peer)
        except Exception as exc:
            raise TransferError(f"NIXL refused the read from {peer}: {exc}") from None
        try:
            state = agent.transfer(xfer)
            deadline, polls = time.monotonic() + self._options.timeout_s, 0
            while state == "PROC":
                if op.is_cancelled:
                    raise TransferError("cancelled")
                polls += 1
                if polls > SPIN_POLLS:
                    if time.monotonic() > deadline:
                        raise TransferError(f"NIXL read from {peer} timed out after "
                                            f"{self._options.timeout_s:g} s")
                    time.sleep(0.0005)
                state = agent.check_xfer_state(xfer)
            if state != "DONE":
                raise TransferError(f"NIXL read from {peer} failed ({state})")
        finally:
            # Releasing an unfinished request aborts it, so no write lands after the op ends.
            try:
                agent.release_xfer_handle(xfer)
            except Exception:  # noqa: BLE001 - already failing; the handle's finalizer retries
                log.warning("could not release a NIXL transfer from %s", peer, exc_info=True)


def _groups(handle: KVHandle) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive blocks: about GROUP_BYTES each, halving towards the end
    (never below one block), so the sums left after the last read are few."""
    groups, start, num_bytes = [], 0, 0
    remaining = handle.num_bytes
    for i, block in enumerate(handle.blocks):
        num_bytes += block.length
        if num_bytes >= min(GROUP_BYTES, remaining // 2):
            groups.append((start, i + 1))
            start, remaining, num_bytes = i + 1, remaining - num_bytes, 0
    if start < len(handle.blocks):
        groups.append((start, len(handle.blocks)))
    return groups
