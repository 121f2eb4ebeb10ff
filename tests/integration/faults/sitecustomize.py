"""A fault for integration tests, loaded by every process of a cluster whose PYTHONPATH starts
here (Python imports ``sitecustomize`` at start-up); nothing outside tests/ knows of it.

``EPD_TEST_HOLD_PREFILL_REPLY=<path>``: in the router only, while ``<path>`` exists, a Prefill
reply that lends KV is held for up to a minute once it has arrived, and ``<path>.held`` is
created. A client that leaves meanwhile abandons a request whose KV prefill has already lent and
whose reply has already been sent: the window a real router has between the reply reaching it
and its task taking it, widened so a test can hit it every time.
"""

from __future__ import annotations

import os
import sys

_PATH = os.environ.get("EPD_TEST_HOLD_PREFILL_REPLY", "")


def _hold_prefill_replies(path: str) -> None:
    import asyncio
    from pathlib import Path

    from services.pb import prefill_pb2_grpc

    make_stub = prefill_pb2_grpc.PrefillStub.__init__

    def __init__(self, channel) -> None:
        make_stub(self, channel)
        prefill = self.Prefill

        async def held(request, **kwargs):
            reply = await prefill(request, **kwargs)
            if reply.HasField("kv") and os.path.exists(path):
                Path(path + ".held").touch()
                await asyncio.sleep(60.0)
            return reply

        self.Prefill = held

    prefill_pb2_grpc.PrefillStub.__init__ = __init__


if _PATH and "services.router" in sys.orig_argv:
    _hold_prefill_replies(_PATH)
