"""Where requests go: the one placement core of the live router and the simulator (STYLE rule 7).

    placer = Placer("prefill", estimates, policy, clock)
    outcome = placer.place(request, item)     # item: what the caller needs back (a future, a record)
    for item, placement in outcome.started: ...send it to placement.instance...
    for item in outcome.failed: ...no instance available: it fails...
    outcome.wake_after_s                      # call placer.dispatch() then, if nothing else does
    placer.release(placement); placer.dispatch()   # its work there is over

Views, queues, dispatch and wake-ups, over one :class:`LoadEstimate` per instance
(``estimate.py``), with an injected clock; no asyncio, no gRPC. The live pool
(``services/router/cluster/instances.py``) adds the load report streams, a future per waiting request and
a timer for the wake-up; the simulator (``services/router/sim/cluster.py``) adds simulated
instances reporting at the live interval and its event clock.

Every request goes through the router's queues (``waiting.py``): under a
:class:`QueueingPolicy` (the prefill buckets) it waits there until the policy's ``dispatch``
starts it; under any other policy ``dispatch`` places it at once wherever ``pick`` says.
``dispatch`` runs on every arrival, load report, release, failure, drain and at the wake-up the
policy asks for. With no instance available at all, what waits fails as unavailable. ``pick``
places one request at once (decode and encoder requests), avoiding instances it failed on while
any other is available.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from services.common.cost_model import PrefillCost
from services.router.policies.base import InstanceView, Pick, Policy, QueueingPolicy, RequestView, available
from services.router.policies.estimate import LoadEstimate
from services.router.policies.waiting import Waiting, dispatched, queue_of

if TYPE_CHECKING:   # annotations only: importing the core loads no protobuf, gRPC or asyncio
    from services.common.wire import LoadReport

T = TypeVar("T")
E = TypeVar("E", bound=LoadEstimate)


@dataclass
class Placement(Generic[E]):
    """Where a request went, and what was counted for it there (see :meth:`Placer.release`)."""

    instance: E
    compute_s: float
    report: int
    """The instance's report count when it was sent."""


@dataclass
class Dispatch(Generic[T, E]):
    """What one dispatch did: the waiting items it started, those that failed (no instance is
    available), and in how many seconds to dispatch again if nothing else happens."""

    started: list[tuple[T, Placement[E]]] = field(default_factory=list)
    failed: list[T] = field(default_factory=list)
    wake_after_s: float | None = None


class Placer(Generic[T, E]):
    def __init__(self, role: str, instances: Sequence[E], policy: Policy, clock: Callable[[], float],
                 health_timeout_s: float = 3.0, cost: PrefillCost = PrefillCost(), eject_after: int = 3,
                 eject_s: float = 1.0, max_eject_s: float = 30.0) -> None:
        self.role = role
        self.instances: list[E] = list(instances)
        self.policy = policy
        self.clock = clock
        self.health_timeout_s = health_timeout_s
        self.cost = cost
        self.eject_after, self.eject_s, self.max_eject_s = eject_after, eject_s, max_eject_s
        self._block_size = 16
        self.picks: Counter[str] = Counter()
        """Picks per policy name (the admin API's per-policy stats)."""
        self.last_pick: Pick | None = None
        self.waiting: Waiting[T] = Waiting()
        """Requests waiting at the router."""
        self._views: list[InstanceView] = []
        self._views_at: float | None = None
        self._changed: set[int] = set()
        """Instances changed through the placer since ``_views`` were taken (at ``_views_at``)."""
        self._index: dict[int, int] = {}
        self._reindex()

    @property
    def block_size(self) -> int:
        """Tokens per KV block (the router learns it from the model)."""
        return self._block_size

    @block_size.setter
    def block_size(self, value: int) -> None:
        self._block_size, self._views_at = value, None

    def views(self) -> list[InstanceView]:
        """One snapshot per instance, now. Within one instant only the instances changed since
        (through the placer: reports, sends, releases, health) are taken again: the simulator
        dispatches once per instance's report, all at the same instant. (An estimate changed
        behind the placer's back shows from the next instant on.)"""
        now = self.clock()
        if now != self._views_at:
            self._views = [self._view(i, now) for i in self.instances]
            self._views_at = now
        else:
            for i in self._changed:
                self._views[i] = self._view(self.instances[i], now)
        self._changed.clear()
        return list(self._views)

    def _view(self, instance: E, now: float) -> InstanceView:
        return instance.view(self.role, now, self.health_timeout_s, self.cost, self._block_size)

    def changed(self, instance: E) -> None:
        """``instance``'s estimate changed (its next view is taken afresh). One removed from the
        pool (a request that outlived its leaving) is no one's business any more."""
        if (i := self._index.get(id(instance))) is not None:
            self._changed.add(i)

    def on_report(self, instance: E, report: LoadReport) -> None:
        """A load report from ``instance``, now. The caller dispatches next."""
        instance.on_report(report, self.clock(), self.cost)
        self.changed(instance)

    def find(self, instance_id_or_address: str) -> E:
        for instance in self.instances:
            if instance_id_or_address in (instance.instance_id, instance.address):
                return instance
        raise KeyError(instance_id_or_address)

    # ----- placing ----------------------------------------------------------------------------
    def pick(self, request: RequestView, arrival: bool = True, avoid: Collection[str] = ()) -> Placement[E] | None:
        """The policy's pick among available instances, now; None (and the request leaves) if
        there is none. ``arrival``: its first placement (a retry is not). ``avoid``: addresses it
        already failed on, not picked while any other instance is available."""
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
            return None
        self.policy.on_pick(request, chosen)
        return self._sent(request, chosen)

    def place(self, request: RequestView, item: T, arrival: bool = True) -> Dispatch[T, E]:
        """``request`` joins the router's queues with ``item``, and whatever can start starts."""
        if arrival:
            self.policy.on_arrival(request)
        self.waiting.add(queue_of(self.policy, request), request, item)
        return self.dispatch()

    def dispatch(self) -> Dispatch[T, E]:
        """Starts what the policy lets start now; fails everything waiting if no instance is
        available; says when to ask again."""
        outcome: Dispatch[T, E] = Dispatch()
        if not len(self.waiting):
            return outcome
        if not any(view.is_available for view in self.views()):
            return self._fail_all()
        for request, chosen, item in dispatched(self.policy, self.waiting, self.views):
            outcome.started.append((item, self._sent(request, chosen)))
        if len(self.waiting):
            if isinstance(self.policy, QueueingPolicy):
                outcome.wake_after_s = self.policy.wake_after_s(self.views())
            else:   # pick found no instance although some are available: nothing will change that
                outcome.failed = self._fail_all().failed
        return outcome

    def _fail_all(self) -> Dispatch[T, E]:
        items = []
        for request, item in self.waiting.drain_requests():
            self.policy.on_leave(request)
            items.append(item)
        return Dispatch(failed=items)

    def _sent(self, request: RequestView, chosen: Pick) -> Placement[E]:
        self.picks[self.policy.name] += 1
        self.last_pick = chosen
        instance = self.find(chosen.instance_id)
        compute_s = instance.cost_scale * self.cost.prompt_seconds(
            request.num_prompt_tokens, request.num_cached_tokens) if self.role == "prefill" else 0.0
        self.changed(instance)
        return Placement(instance, compute_s, instance.on_sent(compute_s))

    def leave(self, request: RequestView, item: T) -> bool:
        """``item``'s caller left while it waited: out of the queue; False if it was not there."""
        if not self.waiting.remove(item):
            return False
        self.policy.on_leave(request)
        return True

    def release(self, placement: Placement[E]) -> None:
        """The request's work at ``placement`` is over (done or failed): uncount it. The caller
        dispatches next (room may have opened)."""
        placement.instance.on_done(placement.compute_s, placement.report)
        self.changed(placement.instance)

    def set_policy(self, policy: Policy) -> None:
        """Switch policies; requests waiting in the old one's queues join the new one's. The
        caller dispatches next."""
        self.policy = policy
        for request, item in self.waiting.drain_requests():
            self.waiting.add(queue_of(policy, request), request, item)

    # ----- health -------------------------------------------------------------------------------
    def failed(self, instance: E) -> float | None:
        """A request failed on it (unavailable, broken or silent): no new work until it reports
        again, and after ``eject_after`` in a row none for a back-off whatever it reports (the
        back-off's seconds are returned; None: not ejected). The caller dispatches next."""
        instance.num_failures += 1
        self.mark_unavailable(instance)
        num_over = instance.num_failures - self.eject_after
        if num_over < 0:
            return None
        eject_s = min(self.max_eject_s, self.eject_s * 2 ** num_over)
        instance.ejected_until = self.clock() + eject_s
        self.changed(instance)
        return eject_s

    def succeeded(self, instance: E) -> None:
        instance.num_failures = 0
        instance.ejected_until = float("-inf")
        self.changed(instance)

    def mark_unavailable(self, instance: E) -> None:
        """An RPC found it unavailable, or its report stream broke: no new work until it
        reports again. The caller dispatches next."""
        instance.is_broken = True
        self.changed(instance)

    def set_drained(self, instance: E, is_drained: bool) -> None:
        """Drained (admin API): no new work. The caller dispatches next."""
        instance.is_drained = is_drained
        self.changed(instance)

    def set_ready(self, instance: E, is_ready: bool) -> None:
        """Its orchestrator's readiness: not ready, no new work. The caller dispatches next."""
        instance.is_ready = is_ready
        self.changed(instance)

    # ----- membership ---------------------------------------------------------------------------
    def add(self, instance: E) -> None:
        """A new instance (its address not in the pool yet). The caller dispatches next."""
        assert all(i.address != instance.address for i in self.instances), f"{instance.address} is in the pool"
        self.instances.append(instance)
        self._reindex()

    def retire(self, instance: E) -> None:
        """``instance`` leaves: no new work from now on; :meth:`remove` it once its requests are
        done. The caller dispatches next."""
        instance.is_leaving = True
        self.changed(instance)

    def remove(self, instance: E) -> None:
        """Out of the pool (its requests are done, or their time is up). The caller dispatches next."""
        self.instances.remove(instance)
        self._reindex()

    def _reindex(self) -> None:
        self._index = {id(instance): i for i, instance in enumerate(self.instances)}
        self._views_at = None
        self._changed.clear()

    def num_serving(self) -> int:
        """Instances known to take requests now: a fresh load report, not ejected, not drained
        (what the router's readiness counts; picks also try instances not heard from yet)."""
        now = self.clock()
        return sum(1 for i, view in zip(self.instances, self.views())
                   if view.is_available and i.is_reporting(now, self.health_timeout_s))
