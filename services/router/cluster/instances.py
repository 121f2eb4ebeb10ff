"""The instances the router sends work to: the placement core plus gRPC.

Each instance streams load reports (``WatchLoad``) to its pool. What the router believes about
an instance (its last report, what it sent since, its health) is a
:class:`~services.router.policies.estimate.LoadEstimate`; where requests go is the
:class:`~services.router.policies.placer.Placer`: views, the router's queues, dispatch and
wake-ups, pure and shared with the simulator. This module adds what only the live router has:
a channel and stub per instance, a task following each report stream, a future per waiting
request, a timer for the policy's wake-up, the ejection metric and logs.

An instance is unhealthy while its report stream is broken, when no report came for
``health_timeout_s``, or right after an RPC to it failed as unavailable; one whose requests
failed ``eject_after`` times in a row is **ejected** (outlier ejection): no new requests for a
back-off that doubles with each further failure (``eject_s`` up to ``max_eject_s``), whatever
its reports say; one success clears it. Unhealthy, ejected and drained instances get no new
requests; requests already there finish.

Under a **queueing** policy (the prefill buckets) :meth:`InstancePool.place` holds a request in
the router's queues until the policy dispatches it: after every load report, every finished
request (:meth:`InstancePool.release`), every arrival, and at the wake-up the policy asks for. A
client that leaves while queued just leaves the queue; with no instance available at all,
waiting requests fail as unavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc
import grpc.aio

from services.common import metrics
from services.common.cost_model import PrefillCost
from services.common.errors import DrainingError, EPDError, UnavailableError
from services.common.server import CHANNEL_OPTIONS
from services.common.wire import load_from_proto
from services.pb import common_pb2
from services.router.policies import InstanceView, Pick, Policy, QueueingPolicy, RequestView
from services.router.policies.estimate import REPORT_INTERVAL_S, LoadEstimate
from services.router.policies.placer import Dispatch, Placement, Placer
from services.router.policies.waiting import Waiting

logger = logging.getLogger(__name__)

S = TypeVar("S")
_RECONNECT_S = 0.5
EJECTIONS = metrics.counter("epd_router_ejections", "Instances taken out of rotation for a back-off after "
                            "consecutive failed requests (outlier ejection), by role.", ["role"])
QUEUE_WAIT = metrics.histogram("epd_router_queue_wait_seconds", "Time a request waited in the router's queue "
                               "until its policy dispatched it (queueing policies).", ["role"],
                               buckets=metrics.TTFT_BUCKETS_S)

__all__ = ["Instance", "InstancePool", "Placement"]


@dataclass(kw_only=True)
class Instance(LoadEstimate, Generic[S]):
    """A live instance: what the router believes of it, and how to reach it."""

    channel: grpc.aio.Channel
    stub: S
    source: str = "static"
    """Where the router learnt of it (membership.py): static, kubernetes, admin, launcher."""
    num_in_flight: int = 0
    """This router's requests using it now (a prefill's until decode took its KV); a leaving
    instance is removed when this reaches 0."""


@dataclass
class _Waiter:
    request: RequestView
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class InstancePool(Generic[S]):
    def __init__(self, role: str, addresses: tuple[str, ...], stub_class: type[S], policy: Policy,
                 health_timeout_s: float = 3.0, report_interval_s: float = REPORT_INTERVAL_S,
                 cost: PrefillCost = PrefillCost(), eject_after: int = 3, eject_s: float = 1.0,
                 max_eject_s: float = 30.0) -> None:
        self.role = role
        self.report_interval_s = report_interval_s
        self._stub_class = stub_class
        self.placer: Placer[_Waiter, Instance[S]] = Placer(
            role, [], policy, time.monotonic, health_timeout_s, cost, eject_after, eject_s, max_eject_s)
        self._wake: asyncio.TimerHandle | None = None
        self._watchers: dict[int, asyncio.Task] = {}
        """id(instance) -> the task following its load reports."""
        self._is_watching = False
        self._retiring: set[asyncio.Task] = set()
        for address in addresses:
            self.add(address)

    # What the admin API and the metrics read: the core's.
    @property
    def instances(self) -> list[Instance[S]]:
        return self.placer.instances

    @property
    def policy(self) -> Policy:
        return self.placer.policy

    @property
    def waiting(self) -> Waiting[_Waiter]:
        return self.placer.waiting

    @property
    def picks(self) -> Counter[str]:
        return self.placer.picks

    @property
    def last_pick(self) -> Pick | None:
        return self.placer.last_pick

    @property
    def cost(self) -> PrefillCost:
        return self.placer.cost

    @property
    def health_timeout_s(self) -> float:
        return self.placer.health_timeout_s

    @property
    def block_size(self) -> int:
        return self.placer.block_size

    @block_size.setter
    def block_size(self, value: int) -> None:
        """Tokens per KV block (the router learns it from the model)."""
        self.placer.block_size = value

    def __len__(self) -> int:
        return len(self.placer.instances)

    def views(self) -> list[InstanceView]:
        return self.placer.views()

    def find(self, instance_id_or_address: str) -> Instance[S]:
        return self.placer.find(instance_id_or_address)

    def pick(self, request: RequestView | None = None, arrival: bool = True,
             avoid: Collection[str] = ()) -> Instance[S]:
        """The policy's pick among healthy, undrained instances, now; UnavailableError if none.
        ``arrival``: the request's first placement (a retry is not). ``avoid``: addresses the
        request already failed on, not picked while any other instance is available."""
        self._check_configured()
        request = request or RequestView("", 0)
        placement = self.placer.pick(request, arrival, avoid)
        if placement is None:
            raise self._unavailable()
        logger.debug("%s pick %s for %s: %s", self.role, placement.instance.address, request.request_id,
                     dict(self.placer.last_pick.breakdown) if self.placer.last_pick else {})
        return placement.instance

    async def place(self, request: RequestView, arrival: bool = True) -> Placement[Instance[S]]:
        """Where ``request`` goes: at once, or under a queueing policy once it dispatches it
        (waiting in the router's queue meanwhile). Hand it back with :meth:`release`."""
        self._check_configured()
        waiter = _Waiter(request)
        is_queueing = isinstance(self.placer.policy, QueueingPolicy)
        try:
            with QUEUE_WAIT.labels(self.role).time() if is_queueing else contextlib.nullcontext():
                self._apply(self.placer.place(request, waiter, arrival))
                return await waiter.future    # at once when it was placed at once
        except asyncio.CancelledError:
            if not self.placer.leave(request, waiter) and waiter.future.done() and not waiter.future.cancelled() \
                    and waiter.future.exception() is None:
                self.release(waiter.future.result())  # dispatched as its caller left
            raise

    def release(self, placement: Placement[Instance[S]]) -> None:
        """The request's work at ``placement`` is over (done or failed): uncount it, and start
        what waits for the room."""
        self.placer.release(placement)
        self.dispatch()

    def dispatch(self) -> None:
        """Starts whatever the policy lets start now (a queueing policy; any other places all)."""
        self._apply(self.placer.dispatch())

    def _apply(self, outcome: Dispatch[_Waiter, Instance[S]]) -> None:
        """Hands each started request its placement, fails the failed, arms the wake-up."""
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        for waiter, placement in outcome.started:
            if waiter.future.done():   # its caller left in between
                self.placer.release(placement)
            else:
                waiter.future.set_result(placement)
        for waiter in outcome.failed:
            if not waiter.future.done():
                waiter.future.set_exception(self._unavailable())
        if outcome.wake_after_s is not None:
            self._wake = asyncio.get_running_loop().call_later(outcome.wake_after_s, self.dispatch)

    def _check_configured(self) -> None:
        if not self.placer.instances:
            raise UnavailableError(f"no {self.role} instance is configured")

    def _unavailable(self) -> UnavailableError:
        return UnavailableError(f"no {self.role} instance is available (all unhealthy or drained)")

    def set_policy(self, policy: Policy) -> None:
        """Switch policies; requests waiting in the old one's queues join the new one's."""
        self.placer.set_policy(policy)
        self.dispatch()

    def mark_unavailable(self, instance: Instance[S]) -> None:
        """An RPC found it unavailable: no new work until it reports again."""
        self.placer.mark_unavailable(instance)
        self.dispatch()

    def failed(self, instance: Instance[S], error: EPDError | None = None) -> None:
        """A request failed on it (unavailable, broken or silent): no new work until it reports
        again, and after ``eject_after`` in a row, none for a back-off whatever it reports. A
        refusal because it drains (``error`` a DrainingError) is no fault: no new work until its
        report, which soon says it drains, and nothing counted toward an ejection."""
        if isinstance(error, DrainingError):
            self.mark_unavailable(instance)
            return
        eject_s = self.placer.failed(instance)
        if eject_s is not None:
            EJECTIONS.labels(self.role).inc()
            logger.warning("%s %s failed %d requests in a row: ejected for %.1f s", self.role,
                           instance.address, instance.num_failures, eject_s)
        self.dispatch()

    def succeeded(self, instance: Instance[S]) -> None:
        self.placer.succeeded(instance)

    def num_serving(self) -> int:
        """Instances known to take requests now: a fresh load report, not ejected, not drained
        (what the router's readiness counts; picks also try instances not heard from yet)."""
        return self.placer.num_serving()

    def set_drained(self, instance: Instance[S], is_drained: bool) -> None:
        self.placer.set_drained(instance, is_drained)
        self.dispatch()

    # ----- membership ----------------------------------------------------------------------------
    def add(self, address: str, source: str = "static", instance_id: str = "", is_ready: bool = True) -> Instance[S]:
        """A new instance. Once the pool follows load reports, it gets work after its first
        one. An instance still leaving at that address stays, and stops leaving."""
        for instance in self.placer.instances:
            if instance.address == address:
                if not instance.is_leaving:
                    raise ValueError(f"{self.role} {address} is already in the pool")
                instance.is_leaving, instance.source = False, source
                self.placer.set_ready(instance, is_ready)
                self.dispatch()
                return instance
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        instance = Instance(address, instance_id=instance_id, channel=channel, stub=self._stub_class(channel),
                            source=source, is_ready=is_ready, needs_report=self._is_watching)
        self.placer.add(instance)
        if self._is_watching:
            self._start_watching(instance)
        logger.info("%s %s joined (%s)", self.role, address, source)
        self.dispatch()
        return instance

    def retire(self, instance: Instance[S], timeout_s: float) -> asyncio.Task:
        """``instance`` leaves: no new work now; removed once this router's requests on it are
        done, or after ``timeout_s`` whatever they are. The task ends when it is out."""
        self.placer.retire(instance)
        self.dispatch()
        task = asyncio.get_running_loop().create_task(self._remove_when_idle(instance, timeout_s))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        return task

    async def _remove_when_idle(self, instance: Instance[S], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while instance.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not instance.is_leaving or instance not in self.placer.instances:
            return   # it came back meanwhile, or is gone already
        if instance.num_in_flight:
            logger.warning("%s %s left with %d requests still on it after %.0f s", self.role,
                           instance.address, instance.num_in_flight, timeout_s)
        self.placer.remove(instance)
        watcher = self._watchers.pop(id(instance), None)
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        await instance.channel.close()
        logger.info("%s %s left (%s)", self.role, instance.address, instance.source)
        self.dispatch()

    def set_ready(self, instance: Instance[S], is_ready: bool) -> None:
        self.placer.set_ready(instance, is_ready)
        self.dispatch()

    @contextlib.contextmanager
    def using(self, instance: Instance[S]) -> Iterator[None]:
        """Counts a request of this router on ``instance`` while the block runs."""
        instance.num_in_flight += 1
        try:
            yield
        finally:
            instance.num_in_flight -= 1

    # ----- load reports ------------------------------------------------------------------------
    def start_watching(self) -> None:
        self._is_watching = True
        for instance in self.placer.instances:
            self._start_watching(instance)

    def _start_watching(self, instance: Instance[S]) -> None:
        self._watchers[id(instance)] = asyncio.get_running_loop().create_task(self._watch(instance))

    async def _watch(self, instance: Instance[S]) -> None:
        request = common_pb2.WatchLoadRequest(interval_s=self.report_interval_s)
        while True:
            try:
                async for message in instance.stub.WatchLoad(request, wait_for_ready=True):
                    self.placer.on_report(instance, load_from_proto(message))
                    self.dispatch()
            except grpc.aio.AioRpcError as exc:
                if not instance.is_broken:
                    logger.warning("%s %s stopped reporting (%s): no new work for it",
                                   self.role, instance.address, exc.code().name)
            self.placer.mark_unavailable(instance)
            self.dispatch()
            await asyncio.sleep(_RECONNECT_S)

    async def close(self) -> None:
        if self._wake is not None:
            self._wake.cancel()
        for waiter in self.placer.waiting.drain():
            waiter.future.cancel()
        for task in [*self._watchers.values(), *self._retiring]:
            task.cancel()
        await asyncio.gather(*self._watchers.values(), *self._retiring, return_exceptions=True)
        for instance in self.placer.instances:
            await instance.channel.close()
