"""The RPCs every instance serves the same way (a servicer mixes them in before its generated
base): GetLoad and WatchLoad over its ``load_report()``, and for an engine service GetModelInfo.
A WatchLoad stream lasts as long as its watcher (a router); a drain does not wait for it
(services/common/server.py)."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any

from services.common.wire import LoadReport, load_to_proto, model_info_to_proto


async def watch_load(report: Callable[[], Any], to_proto: Callable[[Any], Any], interval_s: float,
                     default_interval_s: float = 0.5) -> AsyncIterator[Any]:
    """A WatchLoad RPC's body: the instance's load report now and then every ``interval_s``."""
    while True:
        yield to_proto(report())
        await asyncio.sleep(interval_s or default_interval_s)


class LoadRpcs(ABC):
    """GetLoad and WatchLoad, served the same way by every instance: a servicer mixes this in
    (before its generated base) and gives its ``load_report()``."""

    @abstractmethod
    def load_report(self) -> LoadReport:
        """The instance's load now."""

    async def GetLoad(self, request, context):
        return load_to_proto(self.load_report())

    async def WatchLoad(self, request, context):
        async for report in watch_load(self.load_report, load_to_proto, request.interval_s):
            yield report


class EngineRpcs(LoadRpcs):
    """The instance RPCs of an engine service's servicer over its ``worker`` (prefill, decode)."""

    worker: Any

    def load_report(self) -> LoadReport:
        return self.worker.load_report()

    async def GetModelInfo(self, request, context):
        return model_info_to_proto(self.worker.instance.model_info())
