"""The autoscaled cluster: the planner's own core (``services/router/planner``) scaling the
simulated prefill and decode pools, as the live router's actuators do.

    every interval_s:  signals_from(the placers, now) ──Planner.observe──> desired per role
                       ──> start instances (they serve after SimConfig.startup_s)
                           or retire them (drain, then leave the pool)

Cost is counted in **instance-seconds**: an instance costs from the moment it is started (its
start-up included) until it is removed, one GPU-second per second (an instance is one reference
card in the simulator), over the run from the first arrival to the last token. A fixed fleet's
is its size times that span.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

from services.router.planner.config import PlannerConfig
from services.router.planner.core import Decision, Signals
from services.router.planner.signals import signals_from
from services.router.policies.placer import Placer
from services.router.sim.instances import SimDecode, SimPrefill

SIM_ROLES = ("prefill", "decode")
"""The roles the simulator has (no encoders, the KV store is an index)."""

TIME_FIELDS = ("interval_s", "scale_up_window_s", "scale_down_window_s", "forecast_lead_s", "trend_window_s",
               "backlog_drain_s")
"""The planner's clocks, scaled with the trace's time factor (its SLOs are not: compute is not)."""


class Observer(Protocol):
    """What the simulator drives: the planner, or a baseline with the same entry point."""

    def observe(self, signals: Signals) -> Mapping[str, Decision]: ...


class Cluster(Protocol):
    """What the scaler drives of the simulated cluster (``cluster.py``)."""

    prefill_router: Placer
    decode_router: Placer

    @property
    def clock(self) -> Clock: ...
    def add_instance(self, role: str) -> None: ...
    def retire_instance(self, role: str) -> None: ...
    def members(self, role: str) -> Sequence[SimPrefill | SimDecode]: ...


class Clock(Protocol):
    now: float


class Scaler:
    def __init__(self, planner: Observer, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"the planner's interval_s must be > 0 (got {interval_s!r})")
        self.planner = planner
        self.interval_s = interval_s
        self.replicas: list[tuple[float, dict[str, int]]] = []
        """(time, instances per role counted) at every tick, after its decisions."""
        self.decisions: list[tuple[float, Decision]] = []
        """Every decision that changed a count."""

    def tick(self, cluster: Cluster) -> None:
        now = cluster.clock.now
        signals = signals_from({"prefill": cluster.prefill_router, "decode": cluster.decode_router}, now)
        for role, decision in self.planner.observe(signals).items():
            if role not in SIM_ROLES or decision.desired == decision.current:
                continue
            self.decisions.append((now, decision))
            for _ in range(decision.desired - decision.current):
                cluster.add_instance(role)
            for _ in range(decision.current - decision.desired):
                cluster.retire_instance(role)
        self.record(cluster)

    def record(self, cluster: Cluster) -> None:
        """The instances counted now (the cluster calls it once at the start too)."""
        self.replicas.append((cluster.clock.now, {role: len(cluster.members(role)) for role in SIM_ROLES}))


def scaled_config(config: PlannerConfig, factor: float) -> PlannerConfig:
    """``config`` with its clocks multiplied by ``factor`` (the trace's time factor)."""
    return dataclasses.replace(config, **{name: getattr(config, name) * factor for name in TIME_FIELDS})


def check_sim_limits(config: PlannerConfig) -> None:
    """The simulated pools must never be empty (every request needs a prefill and a decode)."""
    for role in SIM_ROLES:
        limits = config.roles.get(role)
        if limits is not None and limits.is_scaled and limits.min_replicas < 1:
            raise ValueError(f"planner config roles.{role}.min_replicas: the simulator needs >= 1, "
                             f"got {limits.min_replicas}")


def instance_seconds(instances: Sequence[SimPrefill | SimDecode], start: float, end: float) -> float:
    """Seconds each instance existed within [start, end], summed."""
    total = 0.0
    for instance in instances:
        removed = instance.life.removed_at if instance.life.removed_at is not None else end
        total += max(0.0, min(removed, end) - max(instance.life.started_at, start))
    return total
