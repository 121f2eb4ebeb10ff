"""What each role needs, from one instant's signals: pure functions, one per role.

Each returns a :class:`Need`: ``load`` (instances the steady load asks for, which the planner
smooths and projects along its trend), ``extra`` (instances to work off what is owed now, taken
as it is), whether an SLO is being missed right now, the inputs it read, and a phrase for the
reason. None: an input is missing, the role holds.

    prefill   load  = max(R / utilization target, R + sqrt_headroom x sqrt(R)),  R = demand rate / speed
              extra = (router backlog + instances' queued compute) / (speed x backlog_drain_s)
    decode    load  = max(running / (ceiling x running target), KV in use / (KV per instance x KV target))
              ceiling = the most requests a step can carry within the TPOT SLO:
                        a + n (b + c kv_per_request) <= tpot_s, at most decode_max_running
    encoder   load  = patches in flight / patches per instance
    kvstore   load  = used / (capacity per node x capacity target)

Every load is a rate or a level of demand, not a utilization: it does not fall when instances
are added, so adding capacity never argues for removing it again (a utilization-driven rule
does, and flaps).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.cost_model import DecodeCost
from services.router.planner.config import PlannerConfig
from services.router.planner.signals import RoleSignals


@dataclass(frozen=True)
class Need:
    load: float
    """Instances the steady load needs (smoothed and projected by the planner)."""
    extra: float = 0.0
    """Instances to work off what is already owed (not projected)."""
    is_urgent: bool = False
    """An SLO is being missed now: grow without waiting for the scale-up window."""
    inputs: dict[str, float] = field(default_factory=dict)
    text: str = ""
    """What the need rests on, e.g. "prefill demand 3.20 s/s + backlog 4.0 s over 30 s"."""
    target: str = ""
    """The target it is held to, e.g. "0.7 utilization"."""


def prefill(signals: RoleSignals, config: PlannerConfig) -> Need | None:
    if signals.demand_s is None or not signals.period_s or signals.speed is None or signals.speed <= 0:
        return None
    speed = signals.speed
    rates = [d / signals.period_s for d in signals.demand_s]
    rate = sum(rates)
    router_backlog = sum(signals.backlog_s or ())
    backlog = router_backlog + (signals.queued_s or 0.0)
    wait_s = backlog / (speed * max(1, signals.num_ready))
    inputs = {"demand_s_per_s": rate, "backlog_s": backlog, "router_backlog_s": router_backlog,
              "speed": speed, "wait_s": wait_s, "period_s": signals.period_s}
    inputs.update({f"bucket{b}_demand_s_per_s": r for b, r in enumerate(rates)})
    text = f"prefill demand {rate:.2f} s/s"
    if rate > 0 and len(rates) > 1:
        top = max(range(len(rates)), key=lambda b: (rates[b], -b))
        text += f" ({rates[top] / rate:.0%} in bucket {top})"
    text += f" + backlog {backlog:.1f} s over {config.backlog_drain_s:g} s"
    busy = rate / speed   # instances' worth of compute
    load = max(busy / config.prefill_utilization_target, busy + config.prefill_sqrt_headroom * math.sqrt(busy))
    return Need(load=load,
                extra=backlog / (speed * config.backlog_drain_s), is_urgent=wait_s > config.ttft_s,
                inputs=inputs, text=text, target=f"{config.prefill_utilization_target:g} utilization"
                + (f" or {config.prefill_sqrt_headroom:g} x sqrt spare" if config.prefill_sqrt_headroom else ""))


def running_ceiling(cost: DecodeCost, tpot_s: float, kv_per_request: float, max_running: int) -> int:
    """The most requests one decode step can carry within ``tpot_s`` (at least 1)."""
    per_request = cost.b + cost.c * kv_per_request
    if per_request <= 0:
        return max_running
    return max(1, min(max_running, math.floor((tpot_s - cost.a) / per_request)))


def decode(signals: RoleSignals, config: PlannerConfig) -> Need | None:
    if signals.num_running is None:
        return None
    running, kv = signals.num_running, signals.kv_tokens or 0
    kv_per_request = kv / running if running else 0.0
    ceiling = running_ceiling(config.decode_cost, config.tpot_s, kv_per_request, config.decode_max_running)
    by_running = running / (ceiling * config.decode_running_target)
    capacity = signals.kv_capacity_tokens or 0
    by_kv = kv / (capacity * config.decode_kv_target) if capacity > 0 else 0.0
    ready = max(1, signals.num_ready)
    step_s = config.decode_cost.seconds(math.ceil(running / ready), math.ceil(kv / ready))
    inputs = {"running": float(running), "kv_tokens": float(kv), "kv_capacity_tokens": float(capacity),
              "running_ceiling": float(ceiling), "step_s": step_s}
    is_urgent = step_s > config.tpot_s or (capacity > 0 and kv > capacity * ready)
    if by_kv > by_running:
        text = f"decode KV {kv / 1e3:.0f}K tokens of {capacity / 1e3:.0f}K per instance"
        target = f"{config.decode_kv_target:g} KV use"
    else:
        text = f"decode {running} running, at most {ceiling} per instance within TPOT {config.tpot_s * 1e3:g} ms"
        target = f"{config.decode_running_target:g} of that"
    return Need(load=max(by_running, by_kv), is_urgent=is_urgent, inputs=inputs, text=text, target=target)


def encoder(signals: RoleSignals, config: PlannerConfig) -> Need | None:
    if signals.num_patches is None:
        return None
    patches = signals.num_patches
    return Need(load=patches / config.encoder_patches_per_instance, inputs={"patches": float(patches)},
                text=f"encoder {patches} patches in flight",
                target=f"{config.encoder_patches_per_instance:g} per instance")


def kvstore(signals: RoleSignals, config: PlannerConfig) -> Need | None:
    if signals.used is None or not signals.capacity or signals.num_ready < 1:
        return None
    per_node = signals.capacity / signals.num_ready   # the capacity is of the nodes that answered
    return Need(load=signals.used / (per_node * config.kvstore_capacity_target),
                is_urgent=signals.used >= signals.capacity,
                inputs={"used": signals.used, "capacity": signals.capacity},
                text=f"kvstore {signals.used / signals.capacity:.0%} of capacity used",
                target=f"{config.kvstore_capacity_target:g} use")


RULES: dict[str, Callable[[RoleSignals, PlannerConfig], Need | None]] = {
    "encoder": encoder, "prefill": prefill, "decode": decode, "kvstore": kvstore}
