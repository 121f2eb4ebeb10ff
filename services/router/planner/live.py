"""The planner in the live router (the shell around the pure core): every ``interval_s`` the
signals off the router's own pools (and the store nodes' stats), the core's decisions, the
gauges, and the actuator.

    --planner off         no planner
    --planner external    decide and publish only: epd_planner_desired_replicas{role} for KEDA
                          or an HPA to act on, and GET /admin/planner
    --planner launcher    the same; ``epd up --autoscale`` reads GET /admin/planner and starts
                          or stops processes (services/local_scaling.py)
    --planner kubernetes  patch each role's workload scale (kubernetes_actuator.py)

An actuator that fails (the API server away) is logged and counted; the next tick decides and
tries again. Store nodes are polled with a deadline; one that does not answer is left out of
the kvstore signals (the role holds when none answers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Protocol

import grpc.aio

from services.common import metrics
from services.common.server import CHANNEL_OPTIONS
from services.pb import kvstore_pb2, kvstore_pb2_grpc
from services.router.cluster.instances import InstancePool
from services.router.planner.core import Decision, Planner, RoleSignals
from services.router.planner.signals import signals_from

logger = logging.getLogger(__name__)
MODES = ("off", "external", "launcher", "kubernetes")
DESIRED = metrics.gauge("epd_planner_desired_replicas", "Replicas the planner wants for each role now "
                        "(what an external autoscaler such as KEDA or an HPA follows).", ["role"])
CURRENT = metrics.gauge("epd_planner_current_replicas", "Replicas of each role the planner counted "
                        "(serving or starting, not leaving).", ["role"])
ACTUATOR_ERRORS = metrics.counter("epd_planner_actuator_errors", "Scalings the actuator could not apply, by role.",
                                  ["role"])
_STATS_TIMEOUT_S = 2.0


class Actuator(Protocol):
    name: str

    async def scale(self, role: str, replicas: int) -> None:
        ...


class Publisher:
    """The external and launcher modes: the decision is published (gauges, admin API), and
    something outside the router acts on it."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def scale(self, role: str, replicas: int) -> None:
        pass


class LivePlanner:
    def __init__(self, planner: Planner, pools: Mapping[str, InstancePool], actuator: Actuator,
                 kvstores: tuple[str, ...] = ()) -> None:
        self.planner = planner
        self.pools = pools
        self.actuator = actuator
        self._channels = [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in kvstores]
        self._stores = [kvstore_pb2_grpc.KVStoreStub(channel) for channel in self._channels]
        self._task: asyncio.Task | None = None

    @property
    def mode(self) -> str:
        return self.actuator.name

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.planner.config.interval_s)
            try:
                await self.tick()
            except Exception:   # a bug in one tick must not end planning: logged, next tick
                logger.exception("planner tick failed")

    async def tick(self) -> dict[str, Decision]:
        """Signals now, decisions, gauges, and the actuator for each role whose count changes."""
        kvstore = await self._kvstore_signals() if self._stores else None
        placers = {role: pool.placer for role, pool in self.pools.items()}
        decisions = self.planner.observe(signals_from(placers, time.monotonic(), kvstore))
        for role, decision in decisions.items():
            DESIRED.labels(role).set(decision.desired)
            CURRENT.labels(role).set(decision.current)
            if decision.desired == decision.current:
                continue
            logger.info("planner: %s %d -> %d (%s)", role, decision.current, decision.desired, decision.reason)
            try:
                await self.actuator.scale(role, decision.desired)
            except Exception as exc:  # any adapter failure: counted, tried again next tick
                ACTUATOR_ERRORS.labels(role).inc()
                logger.warning("planner: %s could not scale %s to %d: %r", self.actuator.name, role,
                               decision.desired, exc)
        return decisions

    async def _kvstore_signals(self) -> RoleSignals | None:
        answers = await asyncio.gather(*(stub.GetStats(kvstore_pb2.StoreStatsRequest(), timeout=_STATS_TIMEOUT_S)
                                         for stub in self._stores), return_exceptions=True)
        stats = [a for a in answers if not isinstance(a, BaseException)]
        if not stats:
            return None
        return RoleSignals(num_replicas=len(self._stores), num_ready=len(stats),
                           used=float(sum(s.num_blocks for s in stats)),
                           capacity=float(sum(s.host_capacity_blocks + s.disk_capacity_blocks for s in stats)))

    def state(self) -> dict:
        """GET /admin/planner: the mode, the core's state, and ``roles``: each role's last
        decision (current, desired, reason, inputs; none before the first tick)."""
        state = self.planner.state()
        return {"mode": self.mode, "roles": state.pop("last"), **state}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for channel in self._channels:
            await channel.close()
        if (close := getattr(self.actuator, "close", None)) is not None:
            await close()
