"""``RayCluster``: ``epd up``'s Cluster (launcher.py) with each process owned by a Ray actor.

The command lines are the launcher's own (store nodes, engines with the store list, the router
with every instance); only where each runs changes: ``_spawn`` and ``_router`` make a
:class:`RayChild` (an actor handle that acts like a supervised child) instead of a subprocess.
Restarts are Ray's (``max_restarts``), so there is no Supervisor here; ``--autoscale`` runs the
same LocalScaler, which starts and stops actors through this class.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from services.launcher import Cluster, UpConfig, free_port
from services.ray_cluster.actor import NODE_IP, ServiceActor, ServiceSpec
from services.ray_cluster.placement import actor_resources, kvstore_bundles
from services.supervisor import ChildFailed, Probe

logger = logging.getLogger("epd.ray")
SERVICES = {"encoder": "epd.v1.Encoder", "prefill": "epd.v1.Prefill", "decode": "epd.v1.Decode",
            "kvstore": "epd.v1.KVStore"}
STOP_GRACE_S = 30.0
"""Beyond --stop-timeout-s, how long an actor's stop() may take to answer before it is killed."""


def child_line(child: RayChild) -> str:
    """Where one actor runs, as ``epd up --ray`` prints it (tests read it)."""
    info = child.info
    return (f"  {child.name:<10} {child.address}  (pid {info['pid']}, actor pid {info['actor_pid']}, "
            f"node {info['node_id'][:12]}, host id {info['host_id'] or '-'})  metrics {child.metrics_url}")


@functools.cache
def actor_class() -> Any:
    import ray
    return ray.remote(ServiceActor)


@dataclass
class RayChild:
    """One actor as the launcher's code sees a child: name, address, health, start and stop."""

    name: str
    spec: ServiceSpec
    options: dict[str, Any] = field(repr=False)
    address: str = ""
    """Known once healthy (an actor binds its node's address)."""
    metrics_url: str = ""
    healthy_since: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    handle: Any = field(default=None, repr=False)
    is_announced: bool = False
    """Print its line once healthy (an actor started after the banner: scaling)."""

    @property
    def argv(self) -> list[str]:
        return list(self.spec.argv)

    @argv.setter
    def argv(self, value: list[str]) -> None:
        """LocalScaler rewrites the router's command line; a Ray actor restarts with its first one
        (the scaler then registers again what that router does not know)."""

    def spawn(self) -> None:
        self.handle = actor_class().options(**self.options).remote(self.spec)

    async def wait_healthy(self, timeout_s: float) -> None:
        import ray.exceptions

        try:
            info = await asyncio.to_thread(ray.get, self.handle.wait_healthy.remote(timeout_s),
                                           timeout=timeout_s + 60.0)
        except (ray.exceptions.RayError, ChildFailed) as exc:
            raise ChildFailed(f"{self.name} did not come up (Ray placement: {self._placement()}): {exc}") from None
        self.info, self.address, self.healthy_since = info, info["address"], time.monotonic()
        self.metrics_url = self.metrics_url or info["metrics_url"]
        if self.is_announced:
            print(child_line(self), flush=True)

    def _placement(self) -> str:
        """What it asked Ray for: an actor that never starts usually asks for more than any node has."""
        return ", ".join(f"{k}={v}" for k, v in self.options.items() if k in ("num_cpus", "num_gpus", "resources"))

    def request_stop(self, timeout_s: float) -> Any:
        """Ask the actor to stop its process (it drains); the reply's ObjectRef, or None."""
        try:
            return self.handle.stop.remote(timeout_s)
        except Exception as exc:  # the handle is already gone: nothing to drain
            logger.warning("%s: could not ask it to stop: %r", self.name, exc)
            return None

    def finish_stop(self, ref: Any, timeout_s: float) -> None:
        """Wait for the stop (the actor is killed whatever happens), no restart."""
        import ray
        import ray.exceptions

        if ref is not None:
            try:
                ray.get(ref, timeout=max(1.0, timeout_s))
            except (ray.exceptions.RayError, TimeoutError) as exc:
                logger.warning("%s did not stop cleanly: %r", self.name, exc)
        ray.kill(self.handle, no_restart=True)

    def stop(self, timeout_s: float) -> None:
        self.finish_stop(self.request_stop(timeout_s), timeout_s + STOP_GRACE_S)


class RayCluster(Cluster):
    def __init__(self, config: UpConfig, resources: Mapping[str, float], driver_node_id: str) -> None:
        super().__init__(config)
        self.run_id = secrets.token_hex(4)
        self.resources = dict(resources)
        self.driver_node_id = driver_node_id
        self.placement_group: Any = None
        self.is_up = False
        """The banner is out: actors started from now on print their own line."""

    async def start(self) -> str:
        if self.config.kvstores:
            await asyncio.to_thread(self._reserve_kvstore_bundles)
        return await super().start()

    def _reserve_kvstore_bundles(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.placement_group = placement_group(kvstore_bundles(self.config.kvstores, self.resources),
                                               strategy="SPREAD", name=f"epd-{self.run_id}-kvstore")
        try:
            ray.get(self.placement_group.ready(), timeout=self.config.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ChildFailed("the store nodes' placement group was not ready in time: "
                              "too few resources (CPU, epd_kvstore) on the Ray cluster") from None

    def _actor_options(self, name: str, role: str) -> dict[str, Any]:
        options = {**actor_resources(role, self.resources, self.config.device, self.config.ray_gpus_per_engine),
                   "max_restarts": -1,
                   "max_task_retries": 0, "max_concurrency": 4, "name": f"epd-{self.run_id}-{name}"}
        if role == "kvstore" and self.placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=int(name.rsplit("-", 1)[1]))
        elif role == "router":   # its admin API listens on 127.0.0.1: where `epd up` and `epd admin` run
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.driver_node_id, soft=False)
        return options

    def _spawn(self, name: str, module: str, args: list[str]) -> RayChild:
        role = name.rsplit("-", 1)[0]
        port, metrics_port = free_port(self.config.host), free_port(self.config.host)
        argv = (sys.executable, "-m", module, "--host", NODE_IP, "--port", str(port),
                "--metrics-port", str(metrics_port), *args)
        spec = ServiceSpec(name, argv, Probe(grpc_service=SERVICES[role]), port, metrics_port=metrics_port,
                           slot=f"{self.run_id}-{name}")
        child = RayChild(name, spec, self._actor_options(name, role), is_announced=self.is_up)
        child.spawn()
        self.children.append(child)
        return child

    def _router(self, encoders, prefills, decodes) -> RayChild:
        plain = super()._router(encoders, prefills, decodes)
        spec = ServiceSpec("router", tuple(plain.argv), plain.probe, self.config.port, host=self.config.host,
                           slot=f"{self.run_id}-router", env=plain.env)
        return RayChild("router", spec, self._actor_options("router", "router"), metrics_url=plain.metrics_url)

    async def supervise(self, stop: asyncio.Event) -> None:
        """Ray restarts what dies; here: log restarts, and with --autoscale follow the planner."""
        from services.local_scaling import LocalScaler
        from services.ray_cluster.watch import watch_restarts

        tasks = [asyncio.ensure_future(watch_restarts(self.children, stop,
                                                      lambda child: print(child_line(child), flush=True)))]
        if self.config.autoscale:
            tasks.append(asyncio.ensure_future(LocalScaler(self).follow(stop)))
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def stop_child(self, child: RayChild) -> None:
        self.children.remove(child)
        await asyncio.to_thread(child.stop, self.config.stop_timeout_s)

    def stop(self) -> None:
        """The router first (no new work), then every other actor at once: each drains its
        process, then is killed for good; the placement group goes last."""
        import ray

        try:
            routers = [child for child in self.children if child.name == "router"]
            for group in (routers, [child for child in self.children if child.name != "router"]):
                refs = [(child, child.request_stop(self.config.stop_timeout_s)) for child in group]
                deadline = time.monotonic() + self.config.stop_timeout_s + STOP_GRACE_S
                for child, ref in refs:
                    child.finish_stop(ref, deadline - time.monotonic())
            self.children.clear()
        finally:
            if self.placement_group is not None:
                ray.util.remove_placement_group(self.placement_group)
            super().stop()   # removes the planner file; no local children left to stop
