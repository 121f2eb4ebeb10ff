"""A KV store node.

    python -m services.kvstore [--port 50081] [--host-capacity-mib 1024] [--disk-dir DIR]
                               [--redis-url redis://...] ...

Every flag is also an EPD_KVSTORE_* environment variable; ``--help`` lists them.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from prometheus_client import REGISTRY

from kvstore.store import StoreNode
from kvstore.transfer.engine import TRANSPORT_CHOICES, TransferEngine
from services.common.config import config_or_exit
from services.common.server import ServerOptions, serve
from services.kvstore.config import KVStoreConfig
from services.kvstore.peers import Peers
from services.kvstore.servicer import NodeMetrics, add_to_server


async def expire_leases(node: StoreNode, period_s: float = 1.0) -> None:
    while True:
        for lease_id in node.expire_leases():
            logging.getLogger(__name__).warning("store lease %s expired unreleased", lease_id)
        await asyncio.sleep(period_s)


async def run(config: KVStoreConfig) -> int:
    node_id = config.node_id or f"kvstore-{config.port}"
    registry = make_index = None
    if config.redis_url:
        from kvstore.index import EmbeddedIndex
        from kvstore.mirrored_index import MirroredIndex
        from kvstore.redis_index import NodeRegistry
        from services.common.redis_link import sync_client

        # The node decides with its own index and publishes it in Redis for the others, so
        # Redis being down never stops it serving its own blocks (services/kvstore/peers.py).
        registry = NodeRegistry(sync_client(config.redis_url))

        def make_index(capacity: int) -> MirroredIndex:
            return MirroredIndex(EmbeddedIndex(capacity), registry.index_of(node_id, capacity))

    transfer = TransferEngine(host=config.host, port=config.transfer_port,
                              transports=TRANSPORT_CHOICES[config.kv_transport], advertise_host=config.advertise_host)
    node = StoreNode(node_id, config.layout(), transfer, make_index, config.retention())
    peers = Peers(node, registry)
    REGISTRY.register(NodeMetrics(node))

    def ready(port: int, metrics_port: int | None) -> None:
        peers.address = f"{config.advertise_host or config.host}:{port}"

    try:
        return await serve(lambda server: add_to_server(server, node, peers), ServerOptions.from_config(config),
                           "epd.v1.KVStore", ready=ready, background=[expire_leases(node), peers.keep_up()])
    finally:
        node.close()
        transfer.close()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(config_or_exit(KVStoreConfig, argv, "kvstore", prog="python -m services.kvstore")))


if __name__ == "__main__":
    sys.exit(main())
