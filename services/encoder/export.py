"""Embedding rows lent to prefill instances one-sided, under leases (the E of E -> P).

    Encode --> rows in the cache region (a hit: already there) --> lend(entries)
                 one lease per reply; per image a KVHandle naming its chunks, checksummed now
           --> the router forwards the handles in ImageInput.remote --> prefill reads one-sided
           --> Release(lease) from the router once its Prefill call ended, or expiry (ttl_s)
                 either way the entries are unpinned once: cached again, evictable
    The router names each lease in its EncodeRequest, so a client gone mid-Encode releases it
    too: a Release before the grant is remembered, and the grant then ends at once.

The same transfer engine, transports, handles, checksums and ``poll()`` state machine as KV
between prefill and decode (kvstore/transfer); only what the blocks hold differs.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Sequence

from kvstore.transfer.descriptors import KVHandle
from kvstore.transfer.engine import TransferEngine
from kvstore.transfer.leases import LeaseTable
from kvstore.transfer.memory import MemoryRegion
from services.common import metrics
from services.encoder.cache import EmbeddingCache, Entry

logger = logging.getLogger(__name__)
_MAX_RELEASED_EARLY = 4096
LEASES = metrics.counter("epd_encoder_leases_total", "E->P leases on lent embedding rows by how they ended "
                         "(granted; released by the router; expired: nobody released them in time).", ["event"])


class EmbeddingExporter:
    def __init__(self, transfer: TransferEngine, region_bytes: int, lease_ttl_s: float = 60.0,
                 region_id: str | None = None, chunk_bytes: int = 64 << 10) -> None:
        """``transfer``: the engine peers read through (this object registers its region there)."""
        self.transfer = transfer
        region_id = region_id or f"emb-{uuid.uuid4().hex[:8]}"
        try:
            self.region = MemoryRegion.allocate(region_bytes, region_id=region_id)
        except OSError as exc:  # /dev/shm too small (a container's default is 64 MiB)
            logger.warning("no room for %d MiB of embedding rows in /dev/shm (%s): peers read them over "
                           "TCP only", region_bytes >> 20, exc)
            self.region = MemoryRegion.allocate(region_bytes, region_id=region_id, shm=False)
        try:
            transfer.register(self.region)
        except BaseException:
            self.region.close()
            raise
        self.cache = EmbeddingCache(self.region.buffer, chunk_bytes)
        self.leases = LeaseTable(ttl_s=lease_ttl_s)
        self._released_early: OrderedDict[str, bool] = OrderedDict()
        """Lease ids released before they were granted (a caller that gave up on its Encode)."""

    def lend(self, entries: Sequence[Entry], lease_id: str = "") -> tuple[str, list[KVHandle]]:
        """One lease over ``entries`` (each pinned once by the caller: the lease takes those pins
        over) and each entry's handle, in order. ``lease_id``: the caller's name for it; one
        released before it was granted (its reader gave up first) ends at once."""
        lease_id = lease_id or uuid.uuid4().hex
        try:
            handles = [self.transfer.export(self.region.region_id, self.cache.ranges(e), lease_id) for e in entries]
        except BaseException:
            self._unpin(entries)
            raise
        self.leases.grant(lambda: self._unpin(entries), lease_id)
        LEASES.labels("granted").inc()
        if self._released_early.pop(lease_id, False):
            self.release(lease_id)
        return lease_id, handles

    def release(self, lease_id: str) -> bool:
        """The lease's rows are no longer needed by its reader; False: unknown or already ended."""
        released = self.leases.release(lease_id)
        if released:
            LEASES.labels("released").inc()
        else:  # maybe not granted yet (the reply is still on its way): remember, bounded
            self._released_early[lease_id] = True
            while len(self._released_early) > _MAX_RELEASED_EARLY:
                self._released_early.popitem(last=False)
        return released

    async def expire_leases(self, period_s: float = 1.0) -> None:
        """Forever: unpin the rows of every lease nobody released in time."""
        while True:
            for lease_id in self.leases.expire():
                LEASES.labels("expired").inc()
                logger.warning("embedding lease %s expired: nobody released it", lease_id)
            await asyncio.sleep(period_s)

    @property
    def num_leases(self) -> int:
        return len(self.leases)

    def close(self) -> None:
        """Give back every lease, stop serving the region and free it. Idempotent."""
        self.leases.release_all()
        if not self.region.is_closed:
            self.transfer.unregister(self.region.region_id)
            self.region.close()

    def _unpin(self, entries: Sequence[Entry]) -> None:
        for entry in entries:
            self.cache.unpin(entry)


def exporter_from_config(config, instance_id: str) -> EmbeddingExporter | None:
    """The exporter an EncoderConfig asks for (its own transfer engine); None: ``cache_mib`` 0."""
    if config.cache_mib == 0:
        return None
    if config.host in ("0.0.0.0", "::") and not config.advertise_host:
        logger.warning("rows travel inline and nothing is cached: peers cannot dial a wildcard bind address; "
                       "set --advertise-host / EPD_ENCODER_ADVERTISE_HOST to lend rows one-sided")
        return None
    from kvstore.transfer.engine import TRANSPORT_CHOICES

    transfer = TransferEngine(host=config.host, port=config.transfer_port,
                              transports=TRANSPORT_CHOICES[config.kv_transport], advertise_host=config.advertise_host)
    try:
        return EmbeddingExporter(transfer, config.cache_mib << 20, config.lease_ttl_s, f"{instance_id}-emb")
    except BaseException:
        transfer.close()
        raise
