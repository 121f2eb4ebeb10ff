"""The RPCs every instance serves the same way (a servicer mixes them in before its generated
base): GetLoad and WatchLoad over its ``load_report()``, and for an engine service GetModelInfo.
A WatchLoad stream lasts as long as its watcher (a router); a drain does not wait for it
(services/common/server.py), and its start is reported at once (:class:`ReportNow`)."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any

from services.common.wire import LoadReport, load_to_proto, model_info_to_proto


class ReportNow:
    """Wakes an instance's WatchLoad streams so each sends a report at once, between its
    intervals: what its watchers must not learn up to an interval late (a drain starting, when a
    router would go on sending it requests that it refuses)."""

    def __init__(self) -> None:
        self._next = asyncio.Event()

    def __call__(self) -> None:
        self._next.set()
        self._next = asyncio.Event()

    def next_call(self) -> asyncio.Event:
        """Set at the next call: taken before a report is made, so a call while that report is
        on its way (it may predate the change) still wakes the stream for another."""
        return self._next


async def watch_load(report: Callable[[], Any], to_proto: Callable[[Any], Any], interval_s: float,
                     default_interval_s: float = 0.5,
                     woken: ReportNow | None = None) -> AsyncIterator[Any]:
    """A WatchLoad RPC's body: the instance's load report now and then every ``interval_s``, or
    sooner whenever ``woken`` is called."""
    while True:
        wake = asyncio.Event() if woken is None else woken.next_call()
        yield to_proto(report())
        try:
            await asyncio.wait_for(wake.wait(), interval_s or default_interval_s)
        except TimeoutError:
            pass


class LoadRpcs(ABC):
    """GetLoad and WatchLoad, served the same way by every instance: a servicer mixes this in
    (before its generated base) and gives its ``load_report()``."""

    @abstractmethod
    def load_report(self) -> LoadReport:
        """The instance's load now."""

    async def GetLoad(self, request, context):
        return load_to_proto(self.load_report())

    report_now: ReportNow | None = None
    """Wakes the WatchLoad streams (None: they report at their intervals only)."""

    async def WatchLoad(self, request, context):
        async for report in watch_load(self.load_report, load_to_proto, request.interval_s,
                                       woken=self.report_now):
            yield report


class EngineRpcs(LoadRpcs):
    """The instance RPCs of an engine service's servicer over its ``worker`` (prefill, decode)."""

    worker: Any

    def load_report(self) -> LoadReport:
        return self.worker.load_report()

    @property
    def report_now(self) -> ReportNow:
        return self.worker.instance.report_now

    async def GetModelInfo(self, request, context):
        return model_info_to_proto(self.worker.instance.model_info())
