"""The event loop: a whole cluster of simulated prefill and decode instances behind the router's
own placement core.

Life cycle of a request in the simulation::

    arrival (router looks the prefix up) ──> prefill placer (a queueing policy: the request
    waits in the router's queue until it dispatches it) ──> prefill queue ──> prefill (KV store
    hit looked up again when it starts; its new blocks, and SWA window, stored when it ends;
    first token out; the router releases it) ──> decode placer picks ──> decode batch (joins at
    the next step boundary) ──> last token

Routing is the live router's, not a copy of it: one :class:`~services.router.policies.placer.Placer`
per role (views, the router's queues, dispatch, wake-ups) over one
:class:`~services.router.policies.estimate.LoadEstimate` per instance, with the simulation clock. So
policies see what the live router sees: each simulated instance sends a load report every
``SimConfig.report_interval_s`` (the live 0.5 s, scaled with the trace by ``experiment.py``), and
between reports the estimate drains the reported queued compute at one second per second and adds
what the router sent since, priced by the reference cost model scaled to what the instance's report
says of its own queue. Dispatch runs when the live pool runs it: on an arrival, a prefill load
report, a finished prefill (its release), and at the policy's wake-up. The prefix hits come from one
shared KV store on the simulation clock (``hits.py``: block KV, and a hybrid model's SWA windows);
the router's lookup at arrival fills ``RequestView.num_cached_tokens``.

Events at the same instant run decode finishes first, then prefill ends, then load reports, then
arrivals, then wake-ups, then the planner's tick, so a report never shows work that is already over.

**Membership** (the autoscaled cluster, ``scaling.py``): an instance added while the run goes joins
its placer at once but gets no work before its first load report, which comes
``SimConfig.startup_s`` after it was started (model load); a retired one takes no new work, finishes
what it holds and is removed when idle (at once if it was still starting). Each instance's lifetime
(``instances.Lifetime``) is what its instance-seconds are counted over.
"""

from __future__ import annotations

import heapq
import importlib
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.hit_rule import ModelKVShape
from kvstore.index import DEFAULT_CAPACITY_BLOCKS
from kvstore.swa import DEFAULT_SWA_TTL_S
from services.common.cost_model import PrefillCost
from services.router.policies import POLICIES, Policy, RequestView, make_policy
from services.router.policies.estimate import REPORT_INTERVAL_S, LoadEstimate
from services.router.policies.placer import Dispatch, Placement, Placer
from services.router.sim.hits import HitCounts, PrefixHits
from services.router.sim.instances import Queued, SimDecode, SimPrefill
from services.router.sim.trace import SimClock, TraceRequest
from services.router.sim.work import Costs

if TYPE_CHECKING:   # annotations only: scaling.py imports this module
    from services.router.sim.scaling import Scaler

SPEC = "spec"  # the SPEC balancers, one per stage:
SPEC_POLICIES = {"prefill": "prefill_buckets", "decode": "decode_balance"}

_DECODE_FINISH, _PREFILL_DONE, _REPORT, _ARRIVAL, _WAKE, _TICK = range(6)


@dataclass(frozen=True)
class SimConfig:
    num_prefill: int
    num_decode: int
    costs: Costs = field(default_factory=Costs)
    kv_capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS
    """Blocks the shared KV store's index holds (LRU beyond that)."""
    decode_kv_capacity_tokens: int = 0
    """What decode snapshots report as ``kv_capacity_tokens`` (0: unknown)."""
    hits_at: str = "start"
    """When the prefix hit that a prefill computes after is looked up: "start" (when its prefill
    begins, as the reference swaps stored KV in during the forward pass and an engine's own
    prefix cache serves what it computed meanwhile) or "arrival" (only the lookup made when it
    was routed, which a prompt queued behind its own prefix then misses)."""
    report_interval_s: float = REPORT_INTERVAL_S
    """How often each simulated instance reports its load to the router (the live interval;
    ``experiment.py`` scales it with the trace's time factor, as it does the bucket round)."""
    startup_s: float = 60.0
    """How long an instance started during the run loads before it reports and serves (model
    load on the reference card; only the autoscaled cluster starts instances)."""
    kv_shape: ModelKVShape = ModelKVShape()
    """What the model needs from cached KV (a sliding window: hits also need its SWA window)."""
    swa_ttl_s: float = DEFAULT_SWA_TTL_S
    """How long the KV store's SWA tier keeps a window (a hybrid model only)."""

    def __post_init__(self) -> None:
        if self.hits_at not in ("start", "arrival"):
            raise ValueError(f"hits_at must be 'start' or 'arrival' (got {self.hits_at!r})")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(f"need at least one prefill and one decode instance "
                             f"(got {self.num_prefill} and {self.num_decode})")
        if not self.report_interval_s > 0:
            raise ValueError(f"report_interval_s must be > 0 (got {self.report_interval_s!r})")
        if not self.startup_s >= 0:
            raise ValueError(f"startup_s must be >= 0 (got {self.startup_s!r})")
        if not self.swa_ttl_s > 0:
            raise ValueError(f"swa_ttl_s must be > 0 (got {self.swa_ttl_s!r})")


@dataclass
class RequestRecord:
    request: TraceRequest
    block_hashes: tuple[bytes, ...] = ()
    prefill_id: str = ""
    decode_id: str = ""
    num_cached: int = 0
    """Prompt tokens its prefill took from the KV store (looked up as ``SimConfig.hits_at`` says)."""
    num_hit_blocks: int = 0
    prefill_s: float = 0.0
    """Its prefill's compute seconds (after those hits)."""
    first_token_s: float = math.nan
    finish_s: float = math.nan
    placement: Placement | None = None
    """Where the prefill placer sent it (released when its prefill ends)."""

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.request.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first; None with a single output token."""
        if self.request.output_length <= 1:
            return None
        return (self.finish_s - self.first_token_s) / (self.request.output_length - 1)


@dataclass
class SimResult:
    records: list[RequestRecord]
    prefills: list[SimPrefill]
    decodes: list[SimDecode]
    """Every instance that ran, removed ones included (see their ``life``)."""
    prefill_policy: Policy
    replicas: tuple[tuple[float, dict[str, int]], ...] = ()
    """Autoscaled: (time, instances per role counted then) at every planner tick."""
    hits: HitCounts = field(default_factory=HitCounts)  # of the lookups that decided each prefill's hit


def policy_names(policy: str) -> dict[str, str]:
    """Policy per stage: "spec" means the SPEC balancers, any other name is used for both."""
    if policy == SPEC:
        return dict(SPEC_POLICIES)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {SPEC}, {', '.join(sorted(POLICIES))}")
    return {"prefill": policy, "decode": policy}


def build_policy(name: str, seed: int, clock: SimClock, cost: PrefillCost,
                 configure: dict[str, Any] | None = None) -> Policy:
    """``make_policy(name)`` with the settings its constructor takes among a seed, a clock and
    the prefill cost model, then ``configure(**configure)`` where the policy has it (the live
    router's bucket settings)."""
    module, cls = POLICIES[name].split(":")
    accepted = inspect.signature(getattr(importlib.import_module(module), cls)).parameters
    settings = {key: value for key, value in (("seed", seed), ("clock", clock), ("cost", cost))
                if key in accepted}
    policy = make_policy(name, **settings)
    if configure and hasattr(policy, "configure"):
        policy.configure(**configure)
    return policy


class Cluster:
    def __init__(self, config: SimConfig, prefill_policy: Policy, decode_policy: Policy, clock: SimClock) -> None:
        self.config = config
        self.costs = config.costs
        self.clock = clock
        self.hits = PrefixHits(config.kv_capacity_blocks, clock, config.kv_shape, config.swa_ttl_s)
        self.prefills = [SimPrefill(f"prefill-{i}") for i in range(config.num_prefill)]
        self.decodes = [SimDecode(f"decode-{i}", config.costs.decode, config.costs.decode_max_batch,
                                  config.decode_kv_capacity_tokens) for i in range(config.num_decode)]
        # The router: the live placement core, pricing what it sends by the reference model.
        # Simulated instances never fail or fall silent, so no health timeout applies.
        self.prefill_router: Placer[RequestRecord, LoadEstimate] = Placer(
            "prefill", [LoadEstimate(p.instance_id) for p in self.prefills], prefill_policy, clock,
            health_timeout_s=math.inf, cost=config.costs.prefill)
        self.decode_router: Placer[None, LoadEstimate] = Placer(
            "decode", [LoadEstimate(d.instance_id) for d in self.decodes], decode_policy, clock,
            health_timeout_s=math.inf, cost=config.costs.prefill)
        self._prefill_by_id = {p.instance_id: p for p in self.prefills}
        self._decode_by_id = {d.instance_id: d for d in self.decodes}
        self._estimates = {e.address: e for e in self.prefill_router.instances + self.decode_router.instances}
        self._records: dict[str, RequestRecord] = {}
        self._num_unfinished = 0
        self._wake_at: float | None = None  # the one wake-up the policy last asked for (as the live timer)
        self._events: list[tuple[float, int, int, Any, int]] = []
        self._seq = 0

    @property
    def prefill_policy(self) -> Policy:
        return self.prefill_router.policy

    def run(self, requests: Sequence[TraceRequest], scaler: Scaler | None = None) -> SimResult:
        """Every request to its last token; with ``scaler``, its ``tick`` every ``interval_s``."""
        for request in requests:
            record = RequestRecord(request, request.block_hashes())
            self._records[request.request_id] = record
            self._push(request.arrival_s, _ARRIVAL, record)
        self._num_unfinished = len(requests)
        if requests:
            for instance in self.prefills + self.decodes:
                instance.life.started_at = requests[0].arrival_s
            self._start_reports(requests[0].arrival_s)
            if scaler is not None:
                scaler.record(self)
                self._push(requests[0].arrival_s + scaler.interval_s, _TICK, scaler)
        handlers = {_ARRIVAL: self._route_prefill, _PREFILL_DONE: self._prefill_done, _REPORT: self._report,
                    _TICK: self._tick}
        while self._events:
            at, kind, _, target, version = heapq.heappop(self._events)
            self.clock.now = at
            if kind in handlers:
                handlers[kind](target)
            elif kind == _WAKE:
                if at == self._wake_at:
                    self._wake_at = None
                    self._apply(self.prefill_router.dispatch())
            elif version == target.version:
                self._decode_finish(target)
        replicas = tuple(scaler.replicas) if scaler is not None else ()
        return SimResult(list(self._records.values()), self.prefills, self.decodes, self.prefill_policy, replicas,
                         self.hits.counts)

    def _push(self, at: float, kind: int, target: Any, version: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, kind, self._seq, target, version))

    # ----- load reports -----------------------------------------------------------------------
    def _start_reports(self, start: float) -> None:
        """Every instance reports at the start and every interval after, in step: the router opens
        every report stream when it starts, and an instance reports at once and then every interval
        (live, the phases drift apart slowly; in step, the placer takes each instance's view once
        per instant, which keeps a run of the full trace to seconds)."""
        for router, instances in ((self.prefill_router, self.prefills), (self.decode_router, self.decodes)):
            for instance, estimate in zip(instances, router.instances):
                self._push(start, _REPORT, (router, instance, estimate))

    def _report(self, target: tuple[Placer, SimPrefill | SimDecode, LoadEstimate]) -> None:
        router, instance, estimate = target
        if not self._num_unfinished or instance.life.removed_at is not None:
            return      # all done (the streams stop with the simulation), or the instance is gone
        now = self.clock.now
        router.on_report(estimate, instance.report(now))
        if router is self.prefill_router:
            self._apply(router.dispatch())
        self._push(now + self.config.report_interval_s, _REPORT, target)

    # ----- prefill ----------------------------------------------------------------------------
    def _route_prefill(self, record: RequestRecord) -> None:
        request = record.request
        record.num_hit_blocks, record.num_cached = self.hits.lookup(request, self.config.hits_at == "arrival")
        record.prefill_s = self.costs.prefill_seconds(request.input_length, record.num_cached)
        view = RequestView(request.request_id, request.input_length, request.output_length,
                           record.block_hashes, record.num_cached)
        self._apply(self.prefill_router.place(view, record))

    def _apply(self, outcome: Dispatch[RequestRecord, LoadEstimate]) -> None:
        """Sends what the prefill placer started; arms its wake-up (replacing the last one)."""
        if outcome.failed:
            raise RuntimeError(f"{self.prefill_policy.name} failed {len(outcome.failed)} requests as "
                               "unavailable (every simulated instance is available)")
        for record, placement in outcome.started:
            self._send_prefill(record, placement)
        self._wake_at = None
        if outcome.wake_after_s is not None:
            self._wake_at = self.clock.now + outcome.wake_after_s
            self._push(self._wake_at, _WAKE, None)

    def _send_prefill(self, record: RequestRecord, placement: Placement) -> None:
        record.placement, record.prefill_id = placement, placement.instance.instance_id
        instance = self._prefill_by_id[record.prefill_id]
        instance.enqueue(Queued(record.request, record.num_cached, record.prefill_s))
        self._start_prefill(instance)

    def _start_prefill(self, instance: SimPrefill) -> None:
        item = instance.next_up()
        if item is None:
            return
        record, now = self._records[item.request.request_id], self.clock.now
        if self.config.hits_at == "start":
            record.num_hit_blocks, record.num_cached = self.hits.lookup(item.request)
            record.prefill_s = self.costs.prefill_seconds(item.request.input_length, record.num_cached)
        instance.start(item, now, record.prefill_s, item.request.input_length - record.num_cached)
        self._push(now + record.prefill_s, _PREFILL_DONE, instance)

    def _prefill_done(self, instance: SimPrefill) -> None:
        request = instance.finish().request
        record = self._records[request.request_id]
        self.hits.store(request, record.num_hit_blocks)
        record.first_token_s = self.clock.now
        if request.output_length <= 1:
            self._finished(record, self.clock.now)
        else:
            self._route_decode(record)
        self._start_prefill(instance)
        assert record.placement is not None
        self.prefill_router.release(record.placement)   # the Prefill call returned
        self._settle(instance)
        self._apply(self.prefill_router.dispatch())

    # ----- decode -----------------------------------------------------------------------------
    def _route_decode(self, record: RequestRecord) -> None:
        request = record.request
        view = RequestView(request.request_id, request.input_length, request.output_length,
                           record.block_hashes, request.input_length)
        placement = self.decode_router.pick(view)
        if placement is None:
            raise RuntimeError(f"{self.decode_router.policy.name} picked no decode instance (all are available)")
        record.decode_id = placement.instance.instance_id
        instance = self._decode_by_id[record.decode_id]
        for item in instance.join(request, self.clock.now):
            self._finished(self._records[item.request.request_id], instance.synced_at)
        self._schedule_decode(instance)

    def _decode_finish(self, instance: SimDecode) -> None:
        for item in instance.on_finish_event():
            self._finished(self._records[item.request.request_id], self.clock.now)
        self._schedule_decode(instance)
        self._settle(instance)

    def _schedule_decode(self, instance: SimDecode) -> None:
        at = instance.next_finish_at()
        if at is not None:
            self._push(at, _DECODE_FINISH, instance, instance.version)

    def _finished(self, record: RequestRecord, at: float) -> None:
        record.finish_s = at
        self._num_unfinished -= 1

    # ----- membership (the autoscaled cluster) ------------------------------------------------------
    def _tick(self, scaler: Scaler) -> None:
        if self._num_unfinished:
            scaler.tick(self)
            self._push(self.clock.now + scaler.interval_s, _TICK, scaler)

    def members(self, role: str) -> list[SimPrefill | SimDecode]:
        """The role's instances counted now: started, not retiring."""
        return [i for i in (self.prefills if role == "prefill" else self.decodes) if not i.life.is_retiring]

    def add_instance(self, role: str) -> None:
        """Start one more ``role`` instance: it reports, and so serves, after ``startup_s``."""
        now = self.clock.now
        if role == "prefill":
            instance: SimPrefill | SimDecode = SimPrefill(f"prefill-{len(self.prefills)}")
            self.prefills.append(instance)
            self._prefill_by_id[instance.instance_id] = instance
        else:
            instance = SimDecode(f"decode-{len(self.decodes)}", self.costs.decode, self.costs.decode_max_batch,
                                 self.config.decode_kv_capacity_tokens)
            self.decodes.append(instance)
            self._decode_by_id[instance.instance_id] = instance
        instance.life.started_at = now
        estimate = self._estimates[instance.instance_id] = LoadEstimate(instance.instance_id, needs_report=True)
        router = self._router_of(instance)
        router.add(estimate)
        self._push(now + self.config.startup_s, _REPORT, (router, instance, estimate))

    def retire_instance(self, role: str) -> None:
        """Retire one ``role`` instance: one still starting (the newest), else the one holding
        the least work (ties: the newest). It drains, then leaves."""
        estimates = self._estimates
        instance = min(reversed(self.members(role)), key=lambda i: (
            estimates[i.instance_id].load is not None, i.num_requests, -i.life.started_at))
        instance.life.is_retiring = True
        self._router_of(instance).retire(self._estimates[instance.instance_id])
        self._settle(instance)
        if role == "prefill":
            self._apply(self.prefill_router.dispatch())

    def _settle(self, instance: SimPrefill | SimDecode) -> None:
        """A retiring instance with nothing left to do leaves its pool (the caller dispatches)."""
        if instance.life.is_retiring and instance.life.removed_at is None and instance.is_idle:
            self._router_of(instance).remove(self._estimates[instance.instance_id])
            instance.life.removed_at = self.clock.now

    def _router_of(self, instance: SimPrefill | SimDecode) -> Placer:
        return self.prefill_router if isinstance(instance, SimPrefill) else self.decode_router


def simulate(requests: Sequence[TraceRequest], config: SimConfig, policy: str = SPEC, seed: int = 0,
             configure: dict[str, Any] | None = None, scaler: Scaler | None = None) -> SimResult:
    """One run of ``requests`` (arrival order) through a fresh cluster under ``policy``.
    ``configure``: settings for a policy's ``configure`` (the prefill buckets' bounds, caps,
    round period), as the live router passes them. ``scaler``: a planner scaling the cluster
    (``scaling.py``; the config's counts are the fleet it starts with)."""
    clock = SimClock(requests[0].arrival_s if requests else 0.0)
    names = policy_names(policy)
    cluster = Cluster(config, build_policy(names["prefill"], seed, clock, config.costs.prefill, configure),
                      build_policy(names["decode"], seed + 1, clock, config.costs.prefill, configure), clock)
    result = cluster.run(requests, scaler)
    unfinished = [r.request.request_id for r in result.records if math.isnan(r.finish_s)]
    if unfinished:
        raise RuntimeError(f"the simulation ended with {len(unfinished)} requests unfinished: {unfinished[:5]}")
    return result
