"""The planner's settings: SLO targets, per-role targets, windows and replica limits.

One frozen dataclass (STYLE rule 10), read from JSON (``PlannerConfig.from_json``) or a dict, and
written back by ``to_dict`` (the admin API shows it). Every check names the field it failed on:

    PlannerConfig.from_dict({"scale_down_window_s": -1})
    ValueError: planner config scale_down_window_s: must be a number >= 0, got -1
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.cost_model import DecodeCost

ROLES = ("encoder", "prefill", "decode", "kvstore")
"""Every role the planner can scale, in the order it decides them."""


@dataclass(frozen=True)
class RoleLimits:
    min_replicas: int
    """Never fewer (also what a role starts at)."""
    max_replicas: int
    """Never more; 0: the planner leaves the role alone."""

    def __post_init__(self) -> None:
        for name in ("min_replicas", "max_replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
        if self.max_replicas and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas: must be <= max_replicas ({self.max_replicas}), got {self.min_replicas}")

    @property
    def is_scaled(self) -> bool:
        return self.max_replicas > 0

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


def _default_roles() -> dict[str, RoleLimits]:
    return {"prefill": RoleLimits(1, 16), "decode": RoleLimits(1, 16)}


@dataclass(frozen=True)
class PlannerConfig:
    interval_s: float = 10.0
    """How often the router samples its signals and decides (the prefill buckets' round)."""
    ttft_s: float = 2.0
    """TTFT SLO: a prefill backlog that would wait longer than this skips the scale-up window."""
    tpot_s: float = 0.05
    """TPOT SLO: sets how many requests a decode instance may run (with ``decode_cost``)."""
    prefill_utilization_target: float = 0.7
    """Share of an instance's compute the steady prefill demand may fill (the rest absorbs bursts)."""
    prefill_sqrt_headroom: float = 1.0
    """Square-root staffing: at least load + this x sqrt(load) prefill instances (load in
    instances' worth of compute). A small fleet needs more spare room than a utilization target
    gives it: one instance 70% busy with long prompts already queues past a TTFT."""
    backlog_drain_s: float = 30.0
    """Prefill work waiting beyond the steady demand should be worked off within this: it asks
    for backlog / (speed x this) more instances."""
    decode_kv_target: float = 0.7
    """Share of a decode instance's KV capacity its requests may hold."""
    decode_running_target: float = 0.8
    """Share of the TPOT-derived ceiling of running requests per decode instance to plan for."""
    decode_max_running: int = 256
    """The engine's batch cap: the ceiling is never above it."""
    decode_cost: DecodeCost = field(default_factory=DecodeCost)
    """The decode step cost model (seconds per step, per sequence, per KV token read)."""
    encoder_patches_per_instance: float = 2048.0
    """Image patches in flight one encoder instance should hold."""
    kvstore_capacity_target: float = 0.8
    """Share of the KV store nodes' capacity that may be used."""
    scale_up_window_s: float = 10.0
    """A larger need must hold this long before the role grows (0: at once). Skipped while an
    SLO is being missed."""
    scale_down_window_s: float = 120.0
    """A smaller need must hold this long before the role shrinks, one replica per decision;
    and never within this long of growing."""
    forecast_lead_s: float = 70.0
    """How far ahead a rising load is projected: an instance started now serves after its
    start-up (model load) and one interval."""
    trend_window_s: float = 120.0
    """The load's level and trend are fitted over this (a robust line, Theil-Sen; 0: no
    smoothing, no forecast)."""
    history_size: int = 100
    """Decisions that changed a count kept for the admin API."""
    roles: Mapping[str, RoleLimits] = field(default_factory=_default_roles)
    """Replica limits per role; a role absent or with max 0 is never scaled."""

    def __post_init__(self) -> None:
        _check_numbers(self)
        if not isinstance(self.decode_cost, DecodeCost):
            raise ValueError(f"planner config decode_cost: must be a DecodeCost, got {self.decode_cost!r}")
        for name in ("a", "b", "c"):
            if not _is_number(getattr(self.decode_cost, name)) or getattr(self.decode_cost, name) < 0:
                raise ValueError(f"planner config decode_cost.{name}: must be a number >= 0, "
                                 f"got {getattr(self.decode_cost, name)!r}")
        if not isinstance(self.roles, Mapping):
            raise ValueError(f"planner config roles: must map role names to limits, got {self.roles!r}")
        for role, limits in self.roles.items():
            if role not in ROLES:
                raise ValueError(f"planner config roles: unknown role {role!r} (known: {', '.join(ROLES)})")
            if not isinstance(limits, RoleLimits):
                raise ValueError(f"planner config roles.{role}: must be RoleLimits, got {limits!r}")

    @property
    def scaled_roles(self) -> tuple[str, ...]:
        """The roles the planner decides, in ROLES order."""
        return tuple(r for r in ROLES if r in self.roles and self.roles[r].is_scaled)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["decode_cost"] = dataclasses.asdict(self.decode_cost)
        d["roles"] = {role: dataclasses.asdict(limits) for role, limits in self.roles.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlannerConfig:
        """The settings ``d`` gives over the defaults; a ValueError names the field that is wrong."""
        if not isinstance(d, Mapping):
            raise ValueError(f"planner config: must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"planner config {unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
        values = dict(d)
        if "decode_cost" in values:
            values["decode_cost"] = _decode_cost(values["decode_cost"])
        if "roles" in values:
            values["roles"] = _roles(values["roles"])
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> PlannerConfig:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"planner config: not valid JSON ({exc})") from None
        return cls.from_dict(d)


_POSITIVE = ("interval_s", "ttft_s", "tpot_s", "backlog_drain_s", "encoder_patches_per_instance")
_FRACTIONS = ("prefill_utilization_target", "decode_kv_target", "decode_running_target",
              "kvstore_capacity_target")
_NON_NEGATIVE = ("prefill_sqrt_headroom", "scale_up_window_s", "scale_down_window_s", "forecast_lead_s",
                 "trend_window_s")
_COUNTS = ("decode_max_running", "history_size")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_numbers(config: PlannerConfig) -> None:
    for name in _POSITIVE + _FRACTIONS + _NON_NEGATIVE:
        value = getattr(config, name)
        if not _is_number(value):
            raise ValueError(f"planner config {name}: must be a finite number, got {value!r}")
        if name in _POSITIVE and value <= 0:
            raise ValueError(f"planner config {name}: must be a number > 0, got {value!r}")
        if name in _FRACTIONS and not 0 < value <= 1:
            raise ValueError(f"planner config {name}: must be in (0, 1], got {value!r}")
        if name in _NON_NEGATIVE and value < 0:
            raise ValueError(f"planner config {name}: must be a number >= 0, got {value!r}")
    for name in _COUNTS:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"planner config {name}: must be an integer >= 1, got {value!r}")


def _decode_cost(value: object) -> DecodeCost:
    if isinstance(value, DecodeCost):
        return value
    if not isinstance(value, Mapping) or set(value) - {"a", "b", "c"}:
        raise ValueError(f"planner config decode_cost: must be an object with a, b, c, got {value!r}")
    return DecodeCost(**value)


def _roles(value: object) -> dict[str, RoleLimits]:
    if not isinstance(value, Mapping):
        raise ValueError(f"planner config roles: must map role names to limits, got {value!r}")
    roles = {}
    for role, limits in value.items():
        if isinstance(limits, RoleLimits):
            roles[role] = limits
            continue
        if not isinstance(limits, Mapping) or set(limits) != {"min_replicas", "max_replicas"}:
            raise ValueError(f"planner config roles.{role}: must be an object with min_replicas and "
                             f"max_replicas, got {limits!r}")
        try:
            roles[role] = RoleLimits(limits["min_replicas"], limits["max_replicas"])
        except ValueError as exc:
            raise ValueError(f"planner config roles.{role}.{exc}") from None
    return roles
