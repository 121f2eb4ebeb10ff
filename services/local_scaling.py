"""``epd up --autoscale``: the planner's local actuator, processes started and stopped as the
router's planner asks.

The planner runs in the router (``--planner launcher``: it decides, publishes, and touches
nothing). ``epd up`` follows it::

    every second: GET /admin/planner ── desired replicas per role ──┐
                                                                     v
    more wanted: start a process of the role ── healthy ── POST /admin/instances (source launcher):
                 the router sends it work after its first load report
    fewer wanted: the newest process of the role ── DELETE /admin/instances/{id}?wait=true (the
                 router sends it nothing new and answers once its requests there are done)
                 ── SIGTERM (it drains what other routers left, then exits) ── out of supervision

One step per role per round; a start that fails is logged and tried again next round. The
router's own command line is rewritten after each change, so a router restarted by the
supervisor starts with the instances of now, and each round registers again any process that
is up but unknown to the router (its POST came while the router was away). Store nodes are not scaled here: every engine is
started with the list of store nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

import httpx

from services.supervisor import Child, ChildFailed

logger = logging.getLogger("epd.up")
SCALED_ROLES = ("prefill", "decode", "encoder")
_POLL_S = 1.0


class Cluster(Protocol):
    """What the scaler needs of ``epd up``'s cluster (launcher.py)."""

    config: Any
    admin_token: str
    router: Child

    def role_children(self, role: str) -> list[Child]: ...
    def spawn_instance(self, role: str) -> Child: ...
    async def stop_child(self, child: Child) -> None: ...
    def router_argv(self) -> list[str]: ...


class LocalScaler:
    def __init__(self, cluster: Cluster, poll_s: float = _POLL_S) -> None:
        self.cluster = cluster
        self.poll_s = poll_s
        self.admin_url = f"http://127.0.0.1:{cluster.config.admin_port}/admin"
        self.headers = {"Authorization": f"Bearer {cluster.admin_token}"}

    async def follow(self, stop: asyncio.Event) -> None:
        """Until ``stop``: converge each role on the planner's desired replicas."""
        async with httpx.AsyncClient(headers=self.headers, timeout=10.0) as client:
            while not stop.is_set():
                try:
                    await self._register_missing(client)
                    desired = await self._desired(client)
                    await asyncio.gather(*(self.step(client, role, n) for role, n in desired.items()))
                except (httpx.HTTPError, ChildFailed, KeyError, ValueError) as exc:
                    logger.warning("scaling: %s (trying again)", exc)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.poll_s)

    async def _register_missing(self, client: httpx.AsyncClient) -> None:
        """A process that is up but that the router does not know (its POST failed: the router
        was restarting) is registered again."""
        reply = await client.get(f"{self.admin_url}/instances")
        reply.raise_for_status()
        known = {instance["address"] for instance in reply.json()}
        for role in SCALED_ROLES:
            for child in self.cluster.role_children(role):
                if child.address not in known and child.healthy_since is not None:
                    await self._register(client, role, child)

    async def _register(self, client: httpx.AsyncClient, role: str, child: Child) -> None:
        reply = await client.post(f"{self.admin_url}/instances", json={
            "role": role, "address": child.address, "instance_id": child.name, "source": "launcher"})
        if reply.status_code != 409:   # 409: it is known already
            reply.raise_for_status()

    async def _desired(self, client: httpx.AsyncClient) -> dict[str, int]:
        reply = await client.get(f"{self.admin_url}/planner")
        reply.raise_for_status()
        roles = reply.json()["roles"]
        return {role: int(roles[role]["desired"]) for role in SCALED_ROLES if role in roles}

    async def step(self, client: httpx.AsyncClient, role: str, desired: int) -> None:
        """One process more or fewer of ``role``, towards ``desired``."""
        children = self.cluster.role_children(role)
        if desired > len(children):
            await self.add(client, role)
        elif desired < len(children):
            await self.remove(client, children[-1])

    async def add(self, client: httpx.AsyncClient, role: str) -> None:
        child = self.cluster.spawn_instance(role)
        logger.info("scaling %s up: starting %s", role, child.name)
        try:
            await child.wait_healthy(self.cluster.config.startup_timeout_s)
        except ChildFailed:
            await self.cluster.stop_child(child)
            raise
        self.cluster.router.argv = self.cluster.router_argv()
        await self._register(client, role, child)
        logger.info("%s (%s) serves", child.name, child.address)

    async def remove(self, client: httpx.AsyncClient, child: Child) -> None:
        logger.info("scaling %s down: draining %s", child.name.rsplit("-", 1)[0], child.name)
        reply = await client.delete(f"{self.admin_url}/instances/{child.name}", params={"wait": "true"},
                                    timeout=self.cluster.config.stop_timeout_s + 60.0)
        if reply.status_code not in (200, 404):   # 404: the router does not have it (restarted)
            reply.raise_for_status()
        await self.cluster.stop_child(child)
        self.cluster.router.argv = self.cluster.router_argv()
        logger.info("%s drained and stopped", child.name)
