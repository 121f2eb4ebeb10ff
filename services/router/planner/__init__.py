"""The planner: replicas per role from the router's own signals (a pure core behind adapters).

    from services.router.planner import Planner, PlannerConfig, signals_from
    planner = Planner(PlannerConfig.from_json(path.read_text()))
    decisions = planner.observe(signals_from({"prefill": prefill_placer, "decode": decode_placer}, now))

``config`` (settings), ``rules`` (each role's need), ``core`` (smoothing, trend, windows, limits,
pause and overrides: the decisions), ``signals`` (the signals read off the placement core). The
live router's actuators and the simulator (``services/router/sim/scaling.py``) apply the
decisions; nothing here does I/O or reads a clock.
"""

from services.router.planner.config import ROLES, PlannerConfig, RoleLimits
from services.router.planner.core import Decision, Planner, RoleSignals, Signals
from services.router.planner.signals import signals_from

__all__ = ["ROLES", "Decision", "Planner", "PlannerConfig", "RoleLimits", "RoleSignals", "Signals", "signals_from"]
