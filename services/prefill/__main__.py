"""The prefill service.

    python -m services.prefill [--model NAME] [--port 50061] [--metrics-port 9061] ...

Every flag is also an EPD_PREFILL_* environment variable; ``--help`` lists them.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from services.engine.threads import sleep_when_idle

sleep_when_idle()  # before the imports below load torch, and libgomp, which reads it once

from services.common import plugins  # noqa: E402
from services.common.config import config_or_exit  # noqa: E402
from services.engine.serving.instance import serve_instance  # noqa: E402
from services.prefill.config import PrefillConfig  # noqa: E402
from services.prefill.servicer import add_to_server  # noqa: E402

WORKERS = {"epd": "services.prefill.worker:PrefillWorker", "vllm": "services.prefill.vllm_worker:VllmPrefillWorker"}
"""The worker of each engine (``--engine``): it builds its instance (engine, staging, transfer)."""


async def run(config: PrefillConfig) -> int:
    worker = plugins.load(WORKERS, config.engine).create(config)
    instance = worker.instance
    return await serve_instance(instance, config, worker, lambda server: add_to_server(server, worker),
                                "epd.v1.Prefill", background=(worker.expire_leases(),),
                                until_settled=worker.leases.until_empty)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(config_or_exit(PrefillConfig, argv, "prefill", prog="python -m services.prefill")))


if __name__ == "__main__":
    sys.exit(main())
