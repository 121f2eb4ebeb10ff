"""The planner's pure core: replicas per role from a recorded series of the router's signals.

    planner = Planner(PlannerConfig.from_json(text))
    decisions = planner.observe(signals_from(placers, now))      # every config.interval_s
    for d in decisions.values():
        if d.desired != d.current: ...start or retire instances (the actuator)...

No clock, no I/O, no asyncio: times come in the signals, so a decision is a function of the
signal series and the config, and the live router, its admin API and the simulator run the same
object. Per role, each observation goes through three stages::

    signals ──rules.py──> Need(load, extra) ──smooth + project the load──> need (instances)
            ──windows──> desired ──override / pause──> Decision(current, desired, reason)

1. **Need** (``rules.py``): prefill from per-bucket compute demand and backlog against the
   instances' measured speed; decode from running requests against a TPOT-derived ceiling and
   from KV use; encoder from patches in flight; kvstore from capacity use.
2. **Smooth and project**: a line is fitted to the load over ``trend_window_s`` (Theil-Sen,
   robust to bursts); the fit at now is the level, and a rising slope is projected
   ``forecast_lead_s`` ahead (an instance started now serves only after its start-up), so
   capacity leads a ramp instead of trailing it by a start-up time. A falling slope is not
   projected, and the plan never drops below the window's mean: shrinking trails the load, it
   does not lead it. ``extra`` (work already owed) is added as it is.
3. **Windows**: grow to the need that held over the last ``scale_up_window_s`` (the smallest of
   those needs), the smoothed one or that of each instant's load alone, whichever is larger
   (smoothing must not delay a surge that is plain in the raw load; one noisy instant does not
   hold for a window); while an SLO is being missed, at once. Shrink one replica per decision,
   only when every smoothed need over the last ``scale_down_window_s`` was below the current
   count, as is the need of this instant's load alone (no step down into a rising load), and
   never within that window of growing. So a load oscillating faster than the windows makes at
   most one change (up to its peaks), and a cycle up-down-up takes at least both windows.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.router.planner.rules import RULES
from services.router.planner.config import ROLES, PlannerConfig, RoleLimits
from services.router.planner.signals import RoleSignals, Signals

__all__ = ["ROLES", "Decision", "Planner", "PlannerConfig", "RoleLimits", "RoleSignals", "Signals", "fit_trend"]

_EPSILON = 1e-9
"""A need of exactly 3.0 instances is 3, not 4, whatever the float rounding."""


@dataclass(frozen=True)
class Decision:
    role: str
    current: int
    desired: int
    reason: str
    """A short sentence naming the binding input."""
    inputs: dict[str, float] = field(default_factory=dict)


def fit_trend(points: Sequence[tuple[float, float]], at: float) -> tuple[float, float]:
    """A robust line through ``points`` (time, value), Theil-Sen: the slope is the median of
    the slopes between every two points, the level the median of what each point says of the
    value at ``at`` along it. Returns (that level, the slope per second); one burst moves
    neither (a least-squares line through a window ending in a spike points steeply up)."""
    slopes = [(v2 - v1) / (t2 - t1) for i, (t1, v1) in enumerate(points) for t2, v2 in points[i + 1:] if t2 != t1]
    slope = _median(slopes) if slopes else 0.0
    return _median([v + slope * (at - t) for t, v in points]), slope


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


NeedPoint = tuple[float, int, int]
"""(time, instances the smoothed and projected load needs, instances that instant's load needs)."""


def held(needs: Sequence[NeedPoint], at: float, window_s: float) -> list[NeedPoint] | None:
    """The needs over the last ``window_s`` up to ``at``: from the latest one taken at or before
    its start; None when the series does not reach back that far."""
    start = at - window_s
    first = max((i for i, (t, _, _) in enumerate(needs) if t <= start + _EPSILON), default=None)
    return None if first is None else list(needs)[first:]


@dataclass
class _RoleState:
    current: int = 0
    """The count the role's signals gave last."""
    loads: deque[tuple[float, float]] = field(default_factory=deque)
    needs: deque[NeedPoint] = field(default_factory=deque)
    last_up_at: float = -math.inf


class Planner:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._paused = False
        self._overrides: dict[str, int] = {}
        self._states: dict[str, _RoleState] = {}
        self._last: dict[str, Decision] = {}
        self._last_at: float | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=config.history_size)
        """The last decisions that changed a count, oldest first, each with its time ``at``."""

    # ----- operator controls (the admin API) ---------------------------------------------------
    @property
    def is_paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Every decision holds (desired == current) until :meth:`resume`; signals are still
        recorded, so the windows are whole when it resumes."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def set_limits(self, role: str, min_replicas: int | None = None, max_replicas: int | None = None) -> None:
        """New limits for ``role`` (the unset one kept; a role not configured starts at 0..0)."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
        old = self.config.roles.get(role, RoleLimits(0, 0))
        limits = RoleLimits(old.min_replicas if min_replicas is None else min_replicas,
                            old.max_replicas if max_replicas is None else max_replicas)
        self.config = dataclasses.replace(self.config, roles={**self.config.roles, role: limits})

    def override(self, role: str, replicas: int | None) -> None:
        """Hold ``role`` at ``replicas`` (within its limits) whatever the signals; None clears."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
        if replicas is None:
            self._overrides.pop(role, None)
        elif isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"override replicas: must be an integer >= 0, got {replicas!r}")
        else:
            self._overrides[role] = replicas

    # ----- deciding --------------------------------------------------------------------------
    def observe(self, signals: Signals) -> dict[str, Decision]:
        """One decision per scaled role (ROLES order), from these signals and the ones before."""
        if self._last_at is not None and signals.at < self._last_at:
            raise ValueError(f"signals must come in time order: {signals.at} after {self._last_at}")
        self._last_at = signals.at
        decisions = {}
        for role in self.config.scaled_roles:
            decision = self._decide(role, signals.roles.get(role), signals.at)
            if decision.desired != decision.current:
                self.history.append({"at": signals.at, **dataclasses.asdict(decision)})
                if decision.desired > decision.current:
                    self._states[role].last_up_at = signals.at
            decisions[role] = decision
        self._last = decisions
        return decisions

    def _decide(self, role: str, signals: RoleSignals | None, at: float) -> Decision:
        state = self._states.setdefault(role, _RoleState())
        limits = self.config.roles[role]
        if signals is None:
            return Decision(role, state.current, state.current, "hold: no signals")
        current = state.current = signals.num_replicas
        need = RULES[role](signals, self.config)
        if need is None:
            desired = limits.clamp(current)
            reason = f"hold: an input is missing{_clamped(current, desired)}"
            inputs: dict[str, float] = {}
        else:
            level, projected = self._project(state, at, need.load)
            amount = projected + need.extra
            wanted = limits.clamp(math.ceil(amount - _EPSILON))
            now_wanted = limits.clamp(math.ceil(need.load + need.extra - _EPSILON))
            _remember(state.needs, (at, wanted, now_wanted),
                      at - max(self.config.scale_up_window_s, self.config.scale_down_window_s))
            desired, verdict = self._windowed(state, limits, current, at, need.is_urgent)
            reason = f"{need.text} needs {wanted} ({now_wanted} now) at {need.target}; {verdict}"
            inputs = {**need.inputs, "load": need.load, "level": level, "projected": projected,
                      "extra": need.extra, "need": amount, "wanted": float(wanted)}
        if role in self._overrides:
            desired = limits.clamp(self._overrides[role])
            reason = f"override: {desired} replicas"
        if self._paused:
            desired, reason = current, "paused"
        return Decision(role, current, desired, reason, inputs)

    def _project(self, state: _RoleState, at: float, load: float) -> tuple[float, float]:
        """(the fitted level now, what to plan for): the fit projected ``forecast_lead_s`` ahead
        on a rising trend, never below the window's mean (on a falling one the fit runs ahead
        of the load, and shrinking should trail it, not lead it)."""
        window = self.config.trend_window_s
        if window <= 0:
            return load, load
        _remember(state.loads, (at, load), at - window, keep_before=False)
        level, slope = fit_trend(list(state.loads), at)
        mean = sum(v for _, v in state.loads) / len(state.loads)
        if at - state.loads[0][0] < window / 2:
            return level, mean   # too short a series to tell a trend from noise
        return level, max(mean, level + max(0.0, slope) * self.config.forecast_lead_s)

    def _windowed(self, state: _RoleState, limits: RoleLimits, current: int, at: float,
                  is_urgent: bool) -> tuple[int, str]:
        """Up to what the smoothed need, or the instant's need, held above ``current`` for the
        whole up window (at once to the larger while an SLO is missed); down one step when the
        smoothed need stayed below it for the down window and the instant's need is below too."""
        _, wanted, now_wanted = state.needs[-1]
        if current < limits.min_replicas:
            return limits.min_replicas, f"up from {current} to the minimum"
        if current > limits.max_replicas:
            return limits.max_replicas, f"down from {current} to the maximum"
        if is_urgent and max(wanted, now_wanted) > current:
            return max(wanted, now_wanted), f"up from {current} at once: an SLO is being missed"
        up_window, down_window = self.config.scale_up_window_s, self.config.scale_down_window_s
        up = held(state.needs, at, up_window)
        target = max(min(n for _, n, _ in up), min(n for _, _, n in up)) if up is not None else current
        if target > current:
            return target, f"up from {current}"
        down = held(state.needs, at, down_window)
        if down is not None and max(n for _, n, _ in down) < current and now_wanted < current and \
                at - state.last_up_at >= down_window:
            return current - 1, f"down from {current} (lower for {down_window:g} s; one step at a time)"
        if max(wanted, now_wanted) > current:
            return current, f"hold at {current}: not yet {up_window:g} s higher"
        if wanted < current and now_wanted >= current:
            return current, f"hold at {current}: the load now asks for {now_wanted}"
        if wanted < current:
            return current, f"hold at {current}: not yet {down_window:g} s lower"
        return current, f"hold at {current}"

    # ----- the admin API's view ------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Everything ``GET /admin/planner`` shows, JSON-able."""
        return {"config": self.config.to_dict(), "paused": self._paused, "overrides": dict(self._overrides),
                "last": {role: dataclasses.asdict(d) for role, d in self._last.items()},
                "history": list(self.history)}


def _remember(series: deque[tuple[float, Any]], point: tuple[float, Any], start: float,
              keep_before: bool = True) -> None:
    """Append ``point``; drop what is older than ``start`` (but the last one at or before it,
    with ``keep_before``: a window needs the value that held at its start)."""
    series.append(point)
    while len(series) > 1 and series[0][0] < start and (not keep_before or series[1][0] <= start):
        series.popleft()


def _clamped(current: int, desired: int) -> str:
    if desired > current:
        return f"; up from {current} to the minimum"
    if desired < current:
        return f"; down from {current} to the maximum"
    return ""
