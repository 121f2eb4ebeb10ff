"""Leases on exported KV: the prefill side holds blocks until decode confirms or time runs out.

    grant(on_release) --> lease_id --+-- release(lease_id)  (decode confirmed / aborted)
                                     +-- expire()            (no word within ttl_s)
    either way on_release runs exactly once, so no block is stranded and none freed twice.

The owner calls ``expire()`` periodically; the clock is injectable so tests move time.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from kvstore.transfer.descriptors import LeaseId


@dataclass(frozen=True)
class _Lease:
    granted_at: float
    on_release: Callable[[], None]


class LeaseTable:
    def __init__(self, ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._leases: dict[LeaseId, _Lease] = {}
        self._lock = threading.Lock()

    def grant(self, on_release: Callable[[], None], lease_id: str | None = None) -> LeaseId:
        lease_id = LeaseId(lease_id or uuid.uuid4().hex)
        with self._lock:
            if lease_id in self._leases:
                raise ValueError(f"lease {lease_id} already granted")
            self._leases[lease_id] = _Lease(self._clock(), on_release)
        return lease_id

    def release(self, lease_id: str) -> bool:
        """Run the lease's on_release; False if it was already released or expired."""
        with self._lock:
            lease = self._leases.pop(LeaseId(lease_id), None)
        if lease is None:
            return False
        lease.on_release()  # outside the lock: it may call back into the owner
        return True

    def expire(self) -> list[LeaseId]:
        """Release every lease older than ttl_s; returns their ids, oldest first."""
        deadline = self._clock() - self.ttl_s
        with self._lock:
            expired = [(lid, lease) for lid, lease in self._leases.items() if lease.granted_at <= deadline]
            for lease_id, _ in expired:
                del self._leases[lease_id]
        for _, lease in expired:
            lease.on_release()
        return [lease_id for lease_id, _ in expired]

    def release_all(self) -> int:
        """Release every lease now (the owner is shutting down); how many there were."""
        with self._lock:
            lease_ids = list(self._leases)
        return sum(self.release(lease_id) for lease_id in lease_ids)

    async def until_empty(self, poll_s: float = 0.02) -> None:
        """Return once every lease has ended (released or expired): a drain waits here for the
        readers of what its process lent."""
        while self._leases:
            await asyncio.sleep(poll_s)

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases
