"""RDMA-style KV transfer: one-sided reads of exported KV blocks from a peer's registered memory.

No torch anywhere in here (numpy copies and sums); transports load lazily through ``registry``.
"""

from kvstore.transfer.checksum import checksum
from kvstore.transfer.descriptors import BlockDesc, Endpoint, HostId, KVHandle, LeaseId, RegionDesc, RegionId
from kvstore.transfer.engine import TransferEngine, local_host_id
from kvstore.transfer.leases import LeaseTable
from kvstore.transfer.memory import MemoryRegion
from kvstore.transfer.registry import TRANSPORTS, load_transport
from kvstore.transfer.state import TransferOp, TransferState

__all__ = [
    "BlockDesc", "Endpoint", "HostId", "KVHandle", "LeaseId", "LeaseTable", "MemoryRegion",
    "RegionDesc", "RegionId", "TRANSPORTS", "TransferEngine", "TransferOp", "TransferState",
    "checksum", "load_transport", "local_host_id",
]
