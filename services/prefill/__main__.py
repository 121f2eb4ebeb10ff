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

from services.common.config import config_or_exit  # noqa: E402
from services.engine.serving.instance import EngineInstance, serve_instance  # noqa: E402
from services.prefill.config import PrefillConfig  # noqa: E402
from services.prefill.servicer import add_to_server  # noqa: E402
from services.prefill.worker import PrefillWorker  # noqa: E402


async def run(config: PrefillConfig) -> int:
    instance = EngineInstance(config, "prefill")
    worker = PrefillWorker(instance, lease_ttl_s=config.lease_ttl_s)
    return await serve_instance(instance, config, worker, lambda server: add_to_server(server, worker),
                                "epd.v1.Prefill", background=(worker.expire_leases(),),
                                until_settled=worker.leases.until_empty)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(config_or_exit(PrefillConfig, argv, "prefill", prog="python -m services.prefill")))


if __name__ == "__main__":
    sys.exit(main())
