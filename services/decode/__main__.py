"""The decode service.

    python -m services.decode [--model NAME] [--port 50071] [--metrics-port 9071] ...

Every flag is also an EPD_DECODE_* environment variable; ``--help`` lists them.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from services.engine.threads import sleep_when_idle

sleep_when_idle()  # before the imports below load torch, and libgomp, which reads it once

from services.common import plugins  # noqa: E402
from services.common.config import config_or_exit  # noqa: E402
from services.decode.config import DecodeConfig  # noqa: E402
from services.decode.servicer import LeaseReleaser, add_to_server  # noqa: E402
from services.engine.serving.instance import serve_instance  # noqa: E402

WORKERS = {"epd": "services.decode.worker:DecodeWorker", "vllm": "services.decode.vllm_worker:VllmDecodeWorker"}
"""The worker of each engine (``--engine``): it builds its instance (engine, staging, transfer)."""


async def run(config: DecodeConfig) -> int:
    releaser = LeaseReleaser()
    worker = plugins.load(WORKERS, config.engine).create(config, releaser)
    instance = worker.instance
    try:
        return await serve_instance(instance, config, worker,
                                    lambda server: add_to_server(server, worker, config.heartbeat_s),
                                    "epd.v1.Decode", until_settled=worker.until_released)
    finally:
        await releaser.close()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(config_or_exit(DecodeConfig, argv, "decode", prog="python -m services.decode")))


if __name__ == "__main__":
    sys.exit(main())
