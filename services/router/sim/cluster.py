"""The event loop: a whole cluster of simulated prefill and decode instances behind the router's
own policies.

Life cycle of a request in the simulation::

    arrival (router looks the prefix up) ──> Prefill LB picks (a queueing policy: the request
    waits in the router's queue until it dispatches it) ──> prefill queue ──> prefill (KV store
    hit looked up again when it starts; its new blocks stored when it ends; first token out)
    ──> Decode LB picks ──> decode batch (joins at the next step boundary) ──> last token

Routing goes through ``services.router.policies`` exactly as the live router calls it: the
policy made by ``make_policy`` gets a ``RequestView`` and one ``InstanceView`` snapshot per
instance, returns a ``Pick``, then hears ``on_pick``; a queueing policy's requests wait in
``services.router.policies.waiting`` and are dispatched after every event, and at the wake-up
the policy asks for. The prefix hits come from one shared
``kvstore.index.EmbeddedIndex`` (the KV store: any prefill instance hits any prefix) on the
simulation clock; the router's lookup at arrival fills ``RequestView.num_cached_tokens``.
Snapshots are exact (the live router's are up to one load report old).

Events at the same instant run decode finishes first, then prefill ends, then arrivals, then
wake-ups, so a snapshot never shows work that is already over.
"""

from __future__ import annotations

import heapq
import importlib
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.index import DEFAULT_CAPACITY_BLOCKS, EmbeddedIndex
from services.common.cost_model import PrefillCost
from services.router.policies import POLICIES, Policy, RequestView, make_policy
from services.router.policies.waiting import Waiting, dispatched
from services.router.sim.instances import Queued, SimDecode, SimPrefill
from services.router.sim.trace import TraceRequest
from services.router.sim.work import CHAT_TTL_S, Costs

SPEC = "spec"
"""The SPEC balancers: prefill_buckets for prefill, decode_balance for decode."""
SPEC_POLICIES = {"prefill": "prefill_buckets", "decode": "decode_balance"}

_DECODE_FINISH, _PREFILL_DONE, _ARRIVAL, _WAKE = 0, 1, 2, 3


class SimClock:
    """The simulation's time, callable like ``time.monotonic`` (policies and the index take it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


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

    def __post_init__(self) -> None:
        if self.hits_at not in ("start", "arrival"):
            raise ValueError(f"hits_at must be 'start' or 'arrival' (got {self.hits_at!r})")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(f"need at least one prefill and one decode instance "
                             f"(got {self.num_prefill} and {self.num_decode})")


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
    prefill_policy: Policy


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
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.clock = clock
        self.index = EmbeddedIndex(config.kv_capacity_blocks, clock=clock)
        self.prefills = [SimPrefill(f"prefill-{i}") for i in range(config.num_prefill)]
        self.decodes = [SimDecode(f"decode-{i}", config.costs.decode, config.costs.decode_max_batch,
                                  config.decode_kv_capacity_tokens) for i in range(config.num_decode)]
        self._prefill_by_id = {p.instance_id: p for p in self.prefills}
        self._decode_by_id = {d.instance_id: d for d in self.decodes}
        self._records: dict[str, RequestRecord] = {}
        self._waiting: Waiting[RequestRecord] = Waiting()
        """Requests a queueing prefill policy holds at the router."""
        self._wake_at: float | None = None
        self._events: list[tuple[float, int, int, Any, int]] = []
        self._seq = 0

    def run(self, requests: Sequence[TraceRequest]) -> SimResult:
        for request in requests:
            record = RequestRecord(request, request.block_hashes())
            self._records[request.request_id] = record
            self._push(request.arrival_s, _ARRIVAL, record)
        while self._events:
            at, kind, _, target, version = heapq.heappop(self._events)
            self.clock.now = at
            if kind == _ARRIVAL:
                self._route_prefill(target)
            elif kind == _PREFILL_DONE:
                self._prefill_done(target)
            elif kind == _WAKE:
                if at == self._wake_at:
                    self._wake_at = None
                    self._dispatch_prefills()
            elif version == target.version:
                self._decode_finish(target)
        return SimResult(list(self._records.values()), self.prefills, self.decodes, self.prefill_policy)

    def _push(self, at: float, kind: int, target: Any, version: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, kind, self._seq, target, version))

    def _pick(self, policy: Policy, view: RequestView, instances: Sequence, role: str) -> str:
        """The live policy's pick over the instances' snapshots (every simulated one is available)."""
        pick = policy.pick(view, [i.view(self.clock.now) for i in instances])
        if pick is None:
            raise RuntimeError(f"{policy.name} picked no {role} instance (all are available)")
        policy.on_pick(view, pick)
        return pick.instance_id

    # ----- prefill ----------------------------------------------------------------------------
    def _route_prefill(self, record: RequestRecord) -> None:
        request = record.request
        record.num_hit_blocks = self.index.lookup(request.hash_ids)
        record.num_cached = request.cached_tokens(record.num_hit_blocks)
        record.prefill_s = self.costs.prefill_seconds(request.input_length, record.num_cached)
        view = RequestView(request.request_id, request.input_length, request.output_length,
                           record.block_hashes, record.num_cached)
        self.prefill_policy.on_arrival(view)
        if self.prefill_policy.queues:
            self._waiting.add(self.prefill_policy.queue_of(view), view, record)
            self._dispatch_prefills()
        else:
            self._send_prefill(record, self._pick(self.prefill_policy, view, self.prefills, "prefill"))

    def _send_prefill(self, record: RequestRecord, instance_id: str) -> None:
        record.prefill_id = instance_id
        instance = self._prefill_by_id[instance_id]
        instance.enqueue(Queued(record.request, record.num_cached, record.prefill_s))
        self._start_prefill(instance)

    def _dispatch_prefills(self) -> None:
        """Whatever the queueing policy starts now; if some still wait, a wake-up when it says."""
        def views() -> list:
            return [p.view(self.clock.now) for p in self.prefills]

        for _, pick, record in dispatched(self.prefill_policy, self._waiting, views):
            self._send_prefill(record, pick.instance_id)
        if not len(self._waiting):
            return
        after = self.prefill_policy.wake_after_s(views())
        if after is None:
            return
        if self._wake_at is None or self.clock.now + after < self._wake_at:
            self._wake_at = self.clock.now + after
            self._push(self._wake_at, _WAKE, None)

    def _start_prefill(self, instance: SimPrefill) -> None:
        item = instance.next_up()
        if item is None:
            return
        record, now = self._records[item.request.request_id], self.clock.now
        if self.config.hits_at == "start":
            record.num_hit_blocks = self.index.lookup(item.request.hash_ids)
            record.num_cached = item.request.cached_tokens(record.num_hit_blocks)
            record.prefill_s = self.costs.prefill_seconds(item.request.input_length, record.num_cached)
        instance.start(item, now, record.prefill_s)
        self._push(now + record.prefill_s, _PREFILL_DONE, instance)

    def _prefill_done(self, instance: SimPrefill) -> None:
        request = instance.finish().request
        record = self._records[request.request_id]
        # The blocks it computed go to the store; the hit ones were renewed by the lookup.
        for block_id in request.hash_ids[record.num_hit_blocks:]:
            self.index.insert(block_id, CHAT_TTL_S)
        record.first_token_s = self.clock.now
        if request.output_length <= 1:
            record.finish_s = self.clock.now
        else:
            self._route_decode(record)
        self._start_prefill(instance)
        if len(self._waiting):
            self._dispatch_prefills()

    # ----- decode -----------------------------------------------------------------------------
    def _route_decode(self, record: RequestRecord) -> None:
        request = record.request
        view = RequestView(request.request_id, request.input_length, request.output_length,
                           record.block_hashes, request.input_length)
        record.decode_id = self._pick(self.decode_policy, view, self.decodes, "decode")
        instance = self._decode_by_id[record.decode_id]
        for item in instance.join(request, self.clock.now):
            self._records[item.request.request_id].finish_s = instance.synced_at
        self._schedule_decode(instance)

    def _decode_finish(self, instance: SimDecode) -> None:
        for item in instance.on_finish_event():
            self._records[item.request.request_id].finish_s = self.clock.now
        self._schedule_decode(instance)

    def _schedule_decode(self, instance: SimDecode) -> None:
        at = instance.next_finish_at()
        if at is not None:
            self._push(at, _DECODE_FINISH, instance, instance.version)


def simulate(requests: Sequence[TraceRequest], config: SimConfig, policy: str = SPEC, seed: int = 0,
             configure: dict[str, Any] | None = None) -> SimResult:
    """One run of ``requests`` (arrival order) through a fresh cluster under ``policy``.
    ``configure``: settings for a policy's ``configure`` (the prefill buckets' bounds, caps,
    round period), as the live router passes them."""
    clock = SimClock()
    clock.now = requests[0].arrival_s if requests else 0.0
    names = policy_names(policy)
    cluster = Cluster(config, build_policy(names["prefill"], seed, clock, config.costs.prefill, configure),
                      build_policy(names["decode"], seed + 1, clock, config.costs.prefill, configure), clock)
    result = cluster.run(requests)
    unfinished = [r.request.request_id for r in result.records if math.isnan(r.finish_s)]
    if unfinished:
        raise RuntimeError(f"the simulation ended with {len(unfinished)} requests unfinished: {unfinished[:5]}")
    return result
