"""The instances the router sends work to, what it knows of their load, and who picks among them.

Each instance streams load reports (``WatchLoad``) to its pool; the pool turns the latest into
an :class:`InstanceView` snapshot and lets the role's policy (``services/router/policies``)
pick. An instance is **unhealthy** while its report stream is broken, when no report came for
``health_timeout_s``, or right after an RPC to it failed as unavailable; an instance never heard
from yet counts as healthy (so a router starting with its instances works at once). An instance
whose requests failed ``eject_after`` times in a row is **ejected** (outlier ejection): no new
requests for a back-off that doubles with each further failure (``eject_s`` up to
``max_eject_s``), whatever its reports say; one success clears it. Unhealthy, ejected and
drained instances get no new requests; requests already there finish.

Between two reports the pool counts the requests it sent (``num_sent``, and their estimated
compute, the reference cost model scaled to what the instance's own fitted model says of its
queue: a CPU engine is far slower than the reference card), so a burst does not all land on the
instance that looked idlest at the last report; the reported queued compute is taken to drain at
one second per second, or by what this router's requests there finished, whichever says more.

Under a **queueing** policy (the prefill buckets) :meth:`InstancePool.place` holds a request in
the router's queues (``services/router/policies/waiting.py``) until the policy dispatches it:
after every load report, every finished request (:meth:`InstancePool.release`), every arrival,
and at the wake-up the policy asks for. A client that leaves while queued just leaves the queue;
with no instance available at all, waiting requests fail as unavailable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc
import grpc.aio

from services.common import metrics
from services.common.cost_model import PrefillCost
from services.common.errors import UnavailableError
from services.common.server import CHANNEL_OPTIONS
from services.common.wire import LoadReport, load_from_proto
from services.pb import common_pb2
from services.router.policies import InstanceView, Pick, Policy, RequestView
from services.router.policies.base import available
from services.router.policies.waiting import Waiting, dispatched

logger = logging.getLogger(__name__)

S = TypeVar("S")
_RECONNECT_S = 0.5
EJECTIONS = metrics.counter("epd_router_ejections", "Instances taken out of rotation for a back-off after "
                            "consecutive failed requests (outlier ejection), by role.", ["role"])
QUEUE_WAIT = metrics.histogram("epd_router_queue_wait_seconds", "Time a request waited in the router's queue "
                               "until its policy dispatched it (queueing policies).", ["role"],
                               buckets=metrics.TTFT_BUCKETS_S)


@dataclass
class Instance(Generic[S]):
    address: str
    channel: grpc.aio.Channel
    stub: S
    instance_id: str = ""
    """From its load reports; its address until the first one."""
    load: LoadReport | None = None
    report_at: float = float("-inf")
    is_broken: bool = False
    """Its report stream failed, or an RPC found it unavailable, since its last report."""
    is_drained: bool = False
    """Drained through the admin API: no new requests."""
    num_sent: int = 0
    """Requests sent since its last report."""
    sent_s: float = 0.0
    """Their estimated prefill compute (those still running)."""
    done_s: float = 0.0
    """Estimated compute of this router's requests that it counted and that finished since."""
    num_reports: int = 0
    """Load reports received (a placement remembers the count it was sent at)."""
    cost_scale: float = 1.0
    """Its own estimate of its queued prefill over the reference cost model's, last time it
    reported both (what the router multiplies its own estimates by)."""
    num_failures: int = 0
    """Requests that failed on it in a row (a success resets it)."""
    ejected_until: float = float("-inf")
    """Outlier ejection: no new requests before this time (monotonic clock)."""

    def __post_init__(self) -> None:
        self.instance_id = self.instance_id or self.address

    def is_healthy(self, now: float, health_timeout_s: float) -> bool:
        if self.is_broken or now < self.ejected_until:
            return False
        return self.load is None or self.is_reporting(now, health_timeout_s)

    def is_reporting(self, now: float, health_timeout_s: float) -> bool:
        """Its latest report is fresh (False before the first one)."""
        return self.load is not None and not self.is_broken and now - self.report_at <= health_timeout_s

    def queued_compute_s(self, load: LoadReport, now: float, cost: PrefillCost) -> float:
        """The instance's own estimate when it has one (its fitted model), else the reference's,
        drained since the report, plus what was sent since."""
        reported = load.queued_prefill_compute_s or cost.seconds(load.num_queued_prefill_tokens)
        drained = max(now - self.report_at, self.done_s) if self.load is not None else self.done_s
        return max(0.0, reported - drained) + self.sent_s

    def on_report(self, report: LoadReport, now: float, cost: PrefillCost) -> None:
        if report.queued_prefill_compute_s > 0 and report.num_queued_prefill_tokens > 0:
            self.cost_scale = report.queued_prefill_compute_s / cost.seconds(report.num_queued_prefill_tokens)
        self.load, self.report_at = report, now
        self.instance_id = report.instance_id or self.address
        self.is_broken, self.num_sent, self.sent_s, self.done_s = False, 0, 0.0, 0.0
        self.num_reports += 1

    def view(self, role: str, now: float, health_timeout_s: float, cost: PrefillCost,
             block_size: int = 16) -> InstanceView:
        load = self.load or LoadReport(self.instance_id, role)
        num_queued = load.num_queued_prefill_tokens
        return InstanceView(
            instance_id=self.instance_id, role=role, machine=self.address.rsplit(":", 1)[0],
            num_running=load.num_running, num_waiting=load.num_waiting + self.num_sent,
            num_queued_prefill_tokens=num_queued,
            queued_compute_s=self.queued_compute_s(load, now, cost),
            num_kv_tokens=load.num_kv_tokens_in_use,
            kv_capacity_tokens=load.num_total_blocks * block_size, num_patches_in_flight=load.num_patches_in_flight,
            is_healthy=self.is_healthy(now, health_timeout_s),
            is_draining=self.is_drained or load.is_draining)


@dataclass
class Placement(Generic[S]):
    """Where a request went, and what the pool counted for it there (see ``release``)."""

    instance: Instance[S]
    compute_s: float
    report: int
    """The instance's report count when it was sent."""


@dataclass
class _Waiter:
    request: RequestView
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class InstancePool(Generic[S]):
    def __init__(self, role: str, addresses: tuple[str, ...], stub_class: type[S], policy: Policy,
                 health_timeout_s: float = 3.0, report_interval_s: float = 0.5,
                 cost: PrefillCost = PrefillCost(), eject_after: int = 3, eject_s: float = 1.0,
                 max_eject_s: float = 30.0) -> None:
        self.role = role
        self.policy = policy
        self.health_timeout_s = health_timeout_s
        self.eject_after, self.eject_s, self.max_eject_s = eject_after, eject_s, max_eject_s
        self.report_interval_s = report_interval_s
        self.cost = cost
        self.block_size = 16
        """Tokens per KV block (the router learns it from the model)."""
        self.instances: list[Instance[S]] = [
            Instance(a, channel := grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS), stub_class(channel))
            for a in addresses]
        self.picks: Counter[str] = Counter()
        """Picks per policy name (the admin API's per-policy stats)."""
        self.last_pick: Pick | None = None
        self.waiting: Waiting[_Waiter] = Waiting()
        """Requests a queueing policy holds at the router."""
        self._wake: asyncio.TimerHandle | None = None
        self._watchers: list[asyncio.Task] = []

    def __len__(self) -> int:
        return len(self.instances)

    def views(self) -> list[InstanceView]:
        now = time.monotonic()
        return [i.view(self.role, now, self.health_timeout_s, self.cost, self.block_size) for i in self.instances]

    def pick(self, request: RequestView | None = None, arrival: bool = True,
             avoid: Collection[str] = ()) -> Instance[S]:
        """The policy's pick among healthy, undrained instances, now; UnavailableError if none.
        ``arrival``: the request's first placement (a retry is not). ``avoid``: addresses the
        request already failed on, not picked while any other instance is available."""
        return self._pick(request or RequestView("", 0), arrival, avoid).instance

    def _pick(self, request: RequestView, arrival: bool, avoid: Collection[str] = ()) -> Placement[S]:
        if not self.instances:
            raise UnavailableError(f"no {self.role} instance is configured")
        if arrival:
            self.policy.on_arrival(request)
        views = self.views()
        if avoid:
            others = [v if i.address not in avoid else dataclasses.replace(v, is_healthy=False)
                      for i, v in zip(self.instances, views)]
            views = others if available(others) else views
        chosen = self.policy.pick(request, views)
        if chosen is None:
            self.policy.on_leave(request)
            raise UnavailableError(f"no {self.role} instance is available (all unhealthy or drained)")
        self.policy.on_pick(request, chosen)
        return self._sent(request, chosen)

    def _sent(self, request: RequestView, chosen: Pick) -> Placement[S]:
        self.picks[self.policy.name] += 1
        self.last_pick = chosen
        instance = self.find(chosen.instance_id)
        compute_s = instance.cost_scale * self.cost.prompt_seconds(
            request.num_prompt_tokens, request.num_cached_tokens) if self.role == "prefill" else 0.0
        instance.num_sent += 1
        instance.sent_s += compute_s
        logger.debug("%s pick %s for %s: %s", self.role, instance.address, request.request_id, dict(chosen.breakdown))
        return Placement(instance, compute_s, instance.num_reports)

    async def place(self, request: RequestView, arrival: bool = True) -> Placement[S]:
        """Where ``request`` goes: at once, or under a queueing policy once it dispatches it
        (waiting in the router's queue meanwhile). Hand it back with :meth:`release`."""
        if not self.policy.queues:
            return self._pick(request, arrival)
        if not self.instances:
            raise UnavailableError(f"no {self.role} instance is configured")
        if arrival:
            self.policy.on_arrival(request)
        waiter = _Waiter(request)
        self.waiting.add(self.policy.queue_of(request), request, waiter)
        self.dispatch()
        try:
            with QUEUE_WAIT.labels(self.role).time():
                return await waiter.future
        except asyncio.CancelledError:
            if self.waiting.remove(waiter):
                self.policy.on_leave(request)
            elif waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result())  # dispatched as its caller left
            raise

    def release(self, placement: Placement[S]) -> None:
        """The request's work at ``placement`` is over (done or failed): uncount it, and start
        what waits for the room."""
        self._uncount(placement)
        self.dispatch()

    @staticmethod
    def _uncount(placement: Placement[S]) -> None:
        instance = placement.instance
        if placement.report == instance.num_reports:     # no report has counted it yet
            instance.num_sent = max(0, instance.num_sent - 1)
            instance.sent_s = max(0.0, instance.sent_s - placement.compute_s)
        else:
            instance.done_s += placement.compute_s

    def dispatch(self) -> None:
        """Starts whatever the policy lets start now (a queueing policy; any other places all)."""
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        if not len(self.waiting):
            return
        if not available(self.views()):
            for waiter in self.waiting.drain():
                self.policy.on_leave(waiter.request)
                if not waiter.future.done():
                    waiter.future.set_exception(UnavailableError(
                        f"no {self.role} instance is available (all unhealthy or drained)"))
            return
        for request, chosen, waiter in dispatched(self.policy, self.waiting, self.views):
            placement = self._sent(request, chosen)
            if waiter.future.done():   # its caller left in between
                self._uncount(placement)
            else:
                waiter.future.set_result(placement)
        if len(self.waiting) and (after := self.policy.wake_after_s(self.views())) is not None:
            self._wake = asyncio.get_running_loop().call_later(after, self.dispatch)

    def set_policy(self, policy: Policy) -> None:
        """Switch policies; requests waiting in the old one's queues join the new one's."""
        self.policy = policy
        waiters = self.waiting.drain()
        for waiter in waiters:
            self.waiting.add(policy.queue_of(waiter.request), waiter.request, waiter)
        self.dispatch()

    def find(self, instance_id_or_address: str) -> Instance[S]:
        for instance in self.instances:
            if instance_id_or_address in (instance.instance_id, instance.address):
                return instance
        raise KeyError(instance_id_or_address)

    def mark_unavailable(self, instance: Instance[S]) -> None:
        """An RPC found it unavailable: no new work until it reports again."""
        instance.is_broken = True
        self.dispatch()

    def failed(self, instance: Instance[S]) -> None:
        """A request failed on it (unavailable, broken or silent): no new work until it reports
        again, and after ``eject_after`` in a row, none for a back-off whatever it reports."""
        instance.num_failures += 1
        num_over = instance.num_failures - self.eject_after
        if num_over >= 0:
            eject_s = min(self.max_eject_s, self.eject_s * 2 ** num_over)
            instance.ejected_until = time.monotonic() + eject_s
            EJECTIONS.labels(self.role).inc()
            logger.warning("%s %s failed %d requests in a row: ejected for %.1f s", self.role,
                           instance.address, instance.num_failures, eject_s)
        self.mark_unavailable(instance)

    def succeeded(self, instance: Instance[S]) -> None:
        instance.num_failures = 0
        instance.ejected_until = float("-inf")

    def num_serving(self) -> int:
        """Instances known to take requests now: a fresh load report, not ejected, not drained
        (what the router's readiness counts; picks also try instances not heard from yet)."""
        now = time.monotonic()
        return sum(1 for i, view in zip(self.instances, self.views())
                   if view.is_available and i.is_reporting(now, self.health_timeout_s))

    def set_drained(self, instance: Instance[S], is_drained: bool) -> None:
        instance.is_drained = is_drained
        self.dispatch()

    # ----- load reports ------------------------------------------------------------------------
    def start_watching(self) -> None:
        self._watchers = [asyncio.get_running_loop().create_task(self._watch(i)) for i in self.instances]

    async def _watch(self, instance: Instance[S]) -> None:
        request = common_pb2.WatchLoadRequest(interval_s=self.report_interval_s)
        while True:
            try:
                async for message in instance.stub.WatchLoad(request, wait_for_ready=True):
                    instance.on_report(load_from_proto(message), time.monotonic(), self.cost)
                    self.dispatch()
            except grpc.aio.AioRpcError as exc:
                if not instance.is_broken:
                    logger.warning("%s %s stopped reporting (%s): no new work for it",
                                   self.role, instance.address, exc.code().name)
            instance.is_broken = True
            self.dispatch()
            await asyncio.sleep(_RECONNECT_S)

    async def close(self) -> None:
        if self._wake is not None:
            self._wake.cancel()
        for waiter in self.waiting.drain():
            waiter.future.cancel()
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        for instance in self.instances:
            await instance.channel.close()
