"""The transport plug-in interface, and the worker plumbing every transport shares.

A transport moves the blocks a ``KVHandle`` names into the caller's destination buffers with
one-sided reads: the owner's engine loop does no per-block work. ``read`` returns at once with
a ``TransferOp``; the copy, and the checksum check of every block after it lands, run on the
transport's worker threads.
"""

from __future__ import annotations

import abc
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

from kvstore.transfer.descriptors import HostId, KVHandle, RegionId
from kvstore.transfer.memory import MemoryRegion
from kvstore.transfer.state import TransferOp

log = logging.getLogger(__name__)


class TransferError(Exception):
    """A per-transfer failure (bad checksum, dead peer, unknown region); becomes ``op.error``."""


@dataclass(frozen=True)
class TransportOptions:
    host_id: HostId
    """This machine's id; same-host transports compare it with the owner's."""
    host: str = "127.0.0.1"
    """Interface the TCP data server binds."""
    port: int = 0
    """Port of the TCP data server; 0 picks a free one."""
    advertise_host: str = ""
    """Host peers dial; "" means ``host``."""
    num_workers: int = 2
    """Reads in flight at once per transport."""
    num_copy_threads: int = 0
    """Threads sharing one same-host read's copying; 0 = min(4, CPU count)."""
    timeout_s: float = 10.0
    """Socket connect / inactivity timeout: a stalled peer fails the read, never hangs it."""


class Transport(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def register(self, region: MemoryRegion) -> None:
        """Make a local region readable by peers."""

    @abc.abstractmethod
    def unregister(self, region_id: RegionId) -> None:
        """Stop serving a region (reads of it fail from now on)."""

    @abc.abstractmethod
    def can_read(self, handle: KVHandle) -> bool:
        """Whether this transport can reach every region the handle's blocks live in."""

    @abc.abstractmethod
    def read(self, handle: KVHandle, destinations: Sequence) -> TransferOp:
        """Start copying ``handle.blocks[i]`` into ``destinations[i]``; never blocks on the copy."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop workers and servers, drop mappings and connections. Idempotent."""


Destination = memoryview


def check_destinations(handle: KVHandle, destinations: Sequence) -> list[Destination]:
    """One writable, contiguous byte buffer per block, each exactly the block's length.

    A mismatch is the caller's bug, so it raises instead of failing the op.
    """
    if len(destinations) != len(handle.blocks):
        raise ValueError(f"{len(destinations)} destinations for {len(handle.blocks)} blocks")
    views = []
    for i, (block, dest) in enumerate(zip(handle.blocks, destinations)):
        view = memoryview(dest)
        if view.readonly or not view.c_contiguous:
            raise ValueError(f"destination {i} must be writable and contiguous")
        view = view.cast("B")
        if view.nbytes != block.length:
            raise ValueError(f"destination {i} has {view.nbytes} bytes, block has {block.length}")
        views.append(view)
    return views


def start_read(executor: ThreadPoolExecutor, handle: KVHandle,
               work: Callable[[TransferOp], None]) -> TransferOp:
    """Run ``work(op)`` on the executor; any exception it raises becomes FAILED, never a hang."""
    op = TransferOp(len(handle.blocks), handle.num_bytes)

    def run() -> None:
        if not op.start():
            return
        try:
            work(op)
        except TransferError as exc:
            op.finish(str(exc))
        except OSError as exc:
            op.finish(f"I/O error: {exc}")
        except Exception as exc:  # a bug, but the caller must still see the op end
            log.exception("transfer worker crashed")
            op.finish(f"internal error: {exc!r}")
        else:
            op.finish("cancelled" if op.is_cancelled else None)

    try:
        executor.submit(run)
    except RuntimeError as exc:  # executor shut down
        op.finish(f"transport closed: {exc}")
    return op


def mismatch(index: int, block_region: str, expected: int, actual: int) -> TransferError:
    return TransferError(f"checksum mismatch on block {index} of region {block_region}: "
                         f"expected {expected:#018x}, got {actual:#018x}")
