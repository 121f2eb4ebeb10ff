"""The planner's signals, read off the router's own placement core (``policies/placer.py``).

The live router and the simulator both hold one :class:`Placer` per role over one
:class:`LoadEstimate` per instance; this defines :class:`RoleSignals` and :class:`Signals` and
turns the placers into them, so both plan from the same numbers. Instances that are leaving are
not counted (they only finish their work); an instance counts as ready with a fresh load report
and not held (drained, not ready, leaving).

- prefill: per-bucket demand and router backlog of the last round from the prefill buckets
  policy (``PrefillBuckets.last_demand_s`` / ``last_backlog_s``, reference cost-model seconds;
  None under any other policy, which keeps no demand), the instances' queued compute and their
  speed, both through each one's ``cost_scale`` (its own fitted model over the reference);
- decode: running + waiting requests, KV tokens held, KV capacity per instance;
- encoder: patches in flight.

The KV store is no placer pool: its adapter passes its ``RoleSignals`` (from the nodes' stats).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.router.policies.base import InstanceView
from services.router.policies.estimate import LoadEstimate
from services.router.policies.placer import Placer
from services.router.policies.prefill_buckets import PrefillBuckets


@dataclass(frozen=True)
class RoleSignals:
    """What one role reports at one instant, as plain numbers; None: not known (the role holds
    when its rule needs it)."""

    num_replicas: int
    """Instances counted now: serving or starting, not leaving."""
    num_ready: int
    """Those serving (a fresh load report, not held)."""
    demand_s: tuple[float, ...] | None = None
    """Prefill: compute each bucket was asked for over the last period (reference seconds)."""
    backlog_s: tuple[float, ...] | None = None
    """Prefill: compute waiting at the router per bucket when that period closed."""
    period_s: float | None = None
    """Prefill: the period ``demand_s`` covers."""
    queued_s: float | None = None
    """Prefill: compute queued at the instances (reference seconds)."""
    speed: float | None = None
    """Prefill: reference seconds of compute one instance does per second (1 / cost_scale)."""
    num_running: int | None = None
    """Decode: requests running or waiting at the instances."""
    kv_tokens: int | None = None
    """Decode: KV tokens their requests hold."""
    kv_capacity_tokens: int | None = None
    """Decode: KV tokens one instance holds (0 or None: not known)."""
    num_patches: int | None = None
    """Encoder: image patches in flight."""
    used: float | None = None
    """KV store: blocks (or bytes) in use over all nodes."""
    capacity: float | None = None
    """KV store: blocks (or bytes) the ready nodes (those that answered) hold in all."""


@dataclass(frozen=True)
class Signals:
    at: float
    """When they were taken (the router's clock, seconds)."""
    roles: Mapping[str, RoleSignals]


_MIN_SPEED_WORK_STEPS = 4
"""Queued work, in steps' fixed costs, below which the reports' ratio is left aside."""


def signals_from(placers: Mapping[str, Placer], now: float, kvstore: RoleSignals | None = None) -> Signals:
    """Signals at ``now`` of every pool in ``placers`` (role -> placer), plus the KV store's."""
    roles = {role: role_signals(role, placer, now) for role, placer in placers.items()}
    if kvstore is not None:
        roles["kvstore"] = kvstore
    return Signals(now, roles)


def role_signals(role: str, placer: Placer, now: float) -> RoleSignals:
    members = [(i, v) for i, v in zip(placer.instances, _views(placer)) if not i.is_leaving]
    num_ready = sum(1 for i, _ in members if i.is_reporting(now, placer.health_timeout_s) and not i.is_held())
    counts = {"num_replicas": len(members), "num_ready": num_ready}
    if role == "prefill":
        return RoleSignals(**counts, **_prefill(placer, members))
    if role == "decode":
        capacities = [v.kv_capacity_tokens for _, v in members if v.kv_capacity_tokens > 0]
        # What the instances report, not the view's waiting count, which adds every request sent
        # since the last report (a routing estimate: short requests done meanwhile count too).
        return RoleSignals(**counts, num_running=sum(i.load.num_running + i.load.num_waiting
                                                     for i, _ in members if i.load is not None),
                           kv_tokens=sum(v.num_kv_tokens for _, v in members),
                           kv_capacity_tokens=sum(capacities) // len(capacities) if capacities else None)
    if role == "encoder":
        return RoleSignals(**counts, num_patches=sum(v.num_patches_in_flight for _, v in members))
    return RoleSignals(**counts)


def _views(placer: Placer) -> list[InstanceView]:
    if isinstance(placer.policy, PrefillBuckets):
        # Close the buckets' round if its time is up, as any dispatch would: a router with
        # nothing waiting dispatches nothing, and its last round's demand would go stale.
        views = placer.views()
        placer.policy.dispatch((), views)
    return placer.views()


def _prefill(placer: Placer, members: list[tuple[LoadEstimate, InstanceView]]) -> dict[str, object]:
    # An instance's views and reports count in its own model's seconds; cost_scale converts.
    inputs: dict[str, object] = {"speed": _speed(placer, [i for i, _ in members]),
                                 "queued_s": sum(v.queued_compute_s / i.cost_scale for i, v in members)}
    if isinstance(placer.policy, PrefillBuckets):
        inputs.update(demand_s=placer.policy.last_demand_s, backlog_s=placer.policy.last_backlog_s,
                      period_s=placer.policy.round_s)
    return inputs


def _speed(placer: Placer, instances: list[LoadEstimate]) -> float:
    """Reference seconds an instance computes per second: what the reference model says of the
    instances' queued tokens over what their own models say, summed over their last reports
    (each one's ``cost_scale``, weighted by its work: a report near the end of a prompt prices
    its last few tokens below one step's fixed cost, and its ratio alone says little). With less
    than a few steps of work queued in all, the median of the last known ratios; 1.0 before any."""
    loads = [i.load for i in instances if i.load is not None and i.load.queued_prefill_compute_s > 0
             and i.load.num_queued_prefill_tokens > 0]
    own_s = sum(load.queued_prefill_compute_s for load in loads)
    if own_s > 0 and own_s >= _MIN_SPEED_WORK_STEPS * placer.cost.a:
        return sum(placer.cost.seconds(load.num_queued_prefill_tokens) for load in loads) / own_s
    speeds = sorted(1.0 / i.cost_scale for i in instances)
    return speeds[len(speeds) // 2] if speeds else 1.0
