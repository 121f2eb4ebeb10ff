"""The planner in the live router: a tick reads the pools (and the store nodes' stats), sets the
gauges and calls the actuator; the admin API shows and steers it; `epd admin` spells the calls."""

from __future__ import annotations

import asyncio
import time

import grpc.aio
import httpx
import pytest
from prometheus_client import REGISTRY

from services.common.wire import LoadReport
from services.pb import kvstore_pb2, kvstore_pb2_grpc
from services.router.admin import cli as admin_cli
from services.router.admin.app import create_admin_app
from services.router.cluster.pipeline import ClusterBackend
from services.router.planner import Planner, PlannerConfig, RoleLimits
from services.router.planner.live import LivePlanner, Publisher

HEADERS = {"Authorization": "Bearer token"}
DECODES = ("10.0.0.2:1", "10.0.0.3:1")


class Recorder:
    name = "recorder"

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, int]] = []
        self.fail = fail

    async def scale(self, role: str, replicas: int) -> None:
        self.calls.append((role, replicas))
        if self.fail:
            raise RuntimeError("the API server is away")


def busy(backend: ClusterBackend, running: int) -> None:
    """Every decode instance reports ``running`` requests."""
    for instance in backend.decodes.instances:
        instance.on_report(LoadReport(instance.address, "decode", num_running=running, num_total_blocks=100),
                           time.monotonic(), backend.decodes.cost)


def config(**settings) -> PlannerConfig:
    return PlannerConfig(scale_up_window_s=0, trend_window_s=0, decode_max_running=2, decode_running_target=1.0,
                         roles={"decode": RoleLimits(1, 4)}, **settings)


def gauge(name: str, role: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"role": role})


def test_a_tick_decides_from_the_pools_sets_the_gauges_and_calls_the_actuator():
    async def main():
        backend = ClusterBackend(("10.0.0.1:1",), DECODES)
        actuator = Recorder()
        live = LivePlanner(Planner(config()), {"prefill": backend.prefills, "decode": backend.decodes}, actuator)
        try:
            busy(backend, 3)                      # 6 running, 2 per instance: 3 instances
            decision = (await live.tick())["decode"]
            assert (decision.current, decision.desired) == (2, 3) and "6 running" in decision.reason
            assert actuator.calls == [("decode", 3)]
            assert gauge("epd_planner_desired_replicas", "decode") == 3
            assert gauge("epd_planner_current_replicas", "decode") == 2
            busy(backend, 1)                      # 2 running: 1 instance, but not before the down window
            assert (await live.tick())["decode"].desired == 2 and actuator.calls == [("decode", 3)]
        finally:
            await live.close()
            await backend.close()

    asyncio.run(main())


def test_an_actuator_that_fails_is_counted_and_planning_goes_on():
    async def main():
        backend = ClusterBackend(("10.0.0.1:1",), DECODES)
        live = LivePlanner(Planner(config()), {"decode": backend.decodes}, Recorder(fail=True))
        before = REGISTRY.get_sample_value("epd_planner_actuator_errors_total", {"role": "decode"}) or 0
        try:
            busy(backend, 3)
            await live.tick()
            await live.tick()
            assert REGISTRY.get_sample_value("epd_planner_actuator_errors_total", {"role": "decode"}) == before + 2
        finally:
            await live.close()
            await backend.close()

    asyncio.run(main())


class Store(kvstore_pb2_grpc.KVStoreServicer):
    async def GetStats(self, request, context):
        return kvstore_pb2.StoreStats(node_id="kvstore-0", num_blocks=90, host_capacity_blocks=100)


def test_store_nodes_stats_feed_the_kvstore_role_and_a_dead_node_is_left_out():
    async def main():
        server = grpc.aio.server()
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(Store(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        backend = ClusterBackend(("10.0.0.1:1",), DECODES)
        settings = PlannerConfig(scale_up_window_s=0, trend_window_s=0, roles={"kvstore": RoleLimits(1, 8)})
        actuator = Recorder()
        live = LivePlanner(Planner(settings), {"decode": backend.decodes}, actuator,
                           kvstores=(f"127.0.0.1:{port}", "127.0.0.1:1"))
        try:
            decision = (await live.tick())["kvstore"]
            # the node that answered holds 90 of its 100 blocks, over the 0.8 target: two nodes'
            # worth, and two are counted (the dead one is starting, as far as anyone knows)
            assert (decision.inputs["used"], decision.inputs["capacity"]) == (90, 100)
            assert (decision.current, decision.desired) == (2, 2) and "90% of capacity" in decision.reason
            await server.stop(None)
            decision = (await live.tick())["kvstore"]                  # no node answers: hold
            assert (decision.desired, decision.reason) == (2, "hold: no signals") and actuator.calls == []
        finally:
            await live.close()
            await backend.close()
            await server.stop(None)

    asyncio.run(main())


def test_the_admin_api_shows_the_planner_and_pauses_overrides_and_limits_it():
    async def main():
        backend = ClusterBackend(("10.0.0.1:1",), DECODES)
        live = LivePlanner(Planner(config()), {"decode": backend.decodes}, Publisher("external"))
        app = create_admin_app({"decode": backend.decodes}, "token", planner=live)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin") as client:
                async def put(body):
                    return await client.put("/admin/planner", json=body, headers=HEADERS)

                busy(backend, 3)
                await live.tick()
                state = (await client.get("/admin/planner", headers=HEADERS)).json()
                assert state["mode"] == "external" and state["roles"]["decode"]["desired"] == 3
                assert [(h["current"], h["desired"]) for h in state["history"]] == [(2, 3)]

                assert (await put({"paused": True})).json()["paused"] is True
                assert (await live.tick())["decode"].desired == 2          # paused: holds
                await put({"paused": False, "roles": {"decode": {"override": 4}}})
                decision = (await live.tick())["decode"]
                assert (decision.desired, decision.reason) == (4, "override: 4 replicas")
                await put({"roles": {"decode": {"override": None, "max_replicas": 2}}})
                assert (await live.tick())["decode"].desired == 2          # the new maximum
                assert live.planner.config.roles["decode"] == RoleLimits(1, 2)

                for body, words in (({"roles": {"router": {"override": 1}}}, "unknown role 'router'"),
                                    ({"roles": {"decode": {"min_replicas": 5}}}, "min_replicas: must be <="),
                                    ({"roles": {"decode": {"override": -1}}}, "override: must be"),
                                    ({"pause": True}, "")):
                    reply = await put(body)
                    assert reply.status_code in (400, 422) and words in reply.text, reply.text
                assert live.planner.config.roles["decode"] == RoleLimits(1, 2)   # nothing half-applied
        finally:
            await live.close()
            await backend.close()

    asyncio.run(main())


@pytest.mark.parametrize("argv, expected", [
    (["add", "decode", "10.0.0.9:5000", "--id", "decode-9"],
     ("POST", "/admin/instances", {"role": "decode", "address": "10.0.0.9:5000", "instance_id": "decode-9"})),
    (["remove", "decode-9", "--wait"], ("DELETE", "/admin/instances/decode-9?wait=true", None)),
    (["planner"], ("GET", "/admin/planner", None)),
    (["planner", "--pause"], ("PUT", "/admin/planner", {"paused": True})),
    (["scale", "decode", "3"], ("PUT", "/admin/planner", {"roles": {"decode": {"override": 3}}})),
    (["scale", "decode", "auto"], ("PUT", "/admin/planner", {"roles": {"decode": {"override": None}}})),
])
def test_epd_admin_spells_the_membership_and_planner_calls(argv, expected):
    assert admin_cli.request(admin_cli.parser().parse_args(["--token", "t", *argv])) == expected
