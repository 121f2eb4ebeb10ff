"""The router: the cluster's HTTP front door (OpenAI API) in front of prefill and decode.

    python -m services.router --prefill 127.0.0.1:50061 --decode 127.0.0.1:50071 [--port 8000]

Every flag is also an EPD_ROUTER_* environment variable; ``--help`` lists them.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import grpc.aio
import uvicorn

from services.common.config import config_or_exit
from services.router.config import RouterConfig
from services.router.http import create_app
from services.router.pipeline import ClusterBackend

logger = logging.getLogger("services.router")


async def run(config: RouterConfig) -> int:
    backend = ClusterBackend(config.prefill, config.decode, config.encoder)
    try:
        await backend.connect(timeout_s=config.connect_timeout_s)
    except grpc.aio.AioRpcError as exc:
        logger.error("no prefill instance described the model within %.0f s: %s", config.connect_timeout_s, exc)
        await backend.close()
        return 1
    app = create_app(backend, served_model_names=list(config.served_model_name))
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level="warning",
        timeout_graceful_shutdown=config.drain_timeout_s))
    logger.info("router serving %s on http://%s:%d/v1", backend.model_name, config.host, config.port)
    try:
        await server.serve()
    finally:
        await backend.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(config_or_exit(RouterConfig, argv, "router", prog="python -m services.router")))


if __name__ == "__main__":
    sys.exit(main())
