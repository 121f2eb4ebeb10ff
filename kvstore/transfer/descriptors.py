"""Wire types of the KV transfer engine: where an instance's KV can be read, and what to read.

Plain frozen dataclasses of ints, strs and tuples so the proto conversion (elsewhere) is
mechanical. A ``KVHandle`` is everything a receiver needs to pull an exported request's KV
with one-sided reads: the owner's endpoint, the owner's regions the blocks live in, and per
block the byte range plus the checksum the receiver verifies after the bytes land.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

HostId = NewType("HostId", str)
"""Names a machine (boot id + hostname); equal host ids mean the peers can share /dev/shm."""

RegionId = NewType("RegionId", str)
LeaseId = NewType("LeaseId", str)


@dataclass(frozen=True)
class Endpoint:
    host_id: HostId
    tcp_address: str
    """``host:port`` of the owner's data server; "" when it runs none."""
    nixl: str = ""
    """The owner's NIXL agent, its metadata and region addresses (``nixl.PeerInfo``); "" when
    it runs no NIXL transport."""


@dataclass(frozen=True)
class RegionDesc:
    region_id: RegionId
    shm_path: str
    """File under /dev/shm holding the region; "" when the region is not in shared memory."""
    length: int

    def __post_init__(self) -> None:
        if self.length <= 0:
            raise ValueError(f"region {self.region_id}: length must be positive, got {self.length}")


@dataclass(frozen=True)
class BlockDesc:
    region_id: RegionId
    offset: int
    length: int
    checksum: int
    """``checksum.checksum`` of the block's bytes at export time (unsigned 64-bit)."""

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"block in {self.region_id}: bad range offset={self.offset} length={self.length}")


@dataclass(frozen=True)
class KVHandle:
    lease_id: LeaseId
    owner: Endpoint
    regions: tuple[RegionDesc, ...]
    blocks: tuple[BlockDesc, ...]

    @property
    def num_bytes(self) -> int:
        return sum(block.length for block in self.blocks)

    def region(self, region_id: RegionId) -> RegionDesc | None:
        return next((r for r in self.regions if r.region_id == region_id), None)
