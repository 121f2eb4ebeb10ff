"""The RPCs every instance serves alike (services/common/instance_rpcs.py): its load report
once and as a stream, and the stream woken between its intervals."""

from __future__ import annotations

import asyncio

from services.common.instance_rpcs import LoadRpcs, ReportNow
from services.common.wire import LoadReport, load_from_proto
from services.pb import common_pb2


def test_every_instance_serves_its_load_report_once_and_as_a_stream():
    reports = iter(LoadReport("encoder-0", "encoder", num_patches_in_flight=n) for n in range(10))

    class Servicer(LoadRpcs):
        def load_report(self) -> LoadReport:
            return next(reports)

    async def main() -> list[LoadReport]:
        servicer = Servicer()
        got = [load_from_proto(await servicer.GetLoad(common_pb2.LoadRequest(), None))]
        stream = servicer.WatchLoad(common_pb2.WatchLoadRequest(interval_s=0.01), None)
        got += [load_from_proto(await anext(stream)) for _ in range(2)]
        await stream.aclose()
        return got

    got = asyncio.run(main())
    assert [(r.instance_id, r.role, r.num_patches_in_flight) for r in got] == [
        ("encoder-0", "encoder", 0), ("encoder-0", "encoder", 1), ("encoder-0", "encoder", 2)]


def test_report_now_wakes_every_load_watch_between_its_intervals():
    """A drain's start reaches the routers at once, not up to an interval later (meanwhile they
    would send requests that the instance refuses)."""
    draining = False

    class Servicer(LoadRpcs):
        report_now = ReportNow()

        def load_report(self) -> LoadReport:
            return LoadReport("decode-0", "decode", is_draining=draining)

    async def main() -> None:
        nonlocal draining
        servicer = Servicer()
        streams = [servicer.WatchLoad(common_pb2.WatchLoadRequest(interval_s=60), None) for _ in range(2)]
        assert [load_from_proto(await anext(s)).is_draining for s in streams] == [False, False]
        nexts = [asyncio.ensure_future(anext(s)) for s in streams]
        await asyncio.sleep(0.05)
        assert not any(n.done() for n in nexts)  # asleep for their 60 s
        draining = True
        servicer.report_now()
        got = await asyncio.wait_for(asyncio.gather(*nexts), 5)
        assert [load_from_proto(r).is_draining for r in got] == [True, True]
        # Woken while a report is on its way (made, not yet taken): it is followed by another.
        servicer.report_now()
        await asyncio.wait_for(anext(streams[0]), 5)
        # Woken once: the next report waits for its interval again.
        later = asyncio.ensure_future(anext(streams[0]))
        await asyncio.sleep(0.05)
        assert not later.done()
        later.cancel()
        await asyncio.gather(later, return_exceptions=True)
        for s in streams:
            await s.aclose()

    asyncio.run(main())
