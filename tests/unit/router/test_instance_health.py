"""What the router believes about an instance's health: outlier ejection, avoiding an instance a
request already failed on, readiness, and a stale report marked as such in the admin API."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx

from services.common.errors import DrainingError
from services.common.wire import LoadReport
from services.router.admin.app import create_admin_app
from services.router.cluster.instances import InstancePool
from services.router.cluster.pipeline import ClusterBackend
from services.router.policies import RequestView, make_policy


def pool_of(num: int, **options) -> InstancePool:
    """``num`` decode instances (never connected) under round robin."""
    return InstancePool("decode", tuple(f"10.0.0.{i}:1" for i in range(num)), lambda channel: None,
                        make_policy("round_robin"), **options)


def report(pool: InstancePool, i: int, age_s: float = 0.0) -> None:
    pool.instances[i].on_report(LoadReport(f"decode-{i}", "decode"), time.monotonic() - age_s, pool.cost)


def run(scenario) -> None:
    async def main():
        pool = pool_of(2, eject_after=2, eject_s=0.2)
        try:
            await scenario(pool)
        finally:
            await pool.close()

    asyncio.run(main())


def test_consecutive_failures_eject_an_instance_for_a_growing_back_off_and_a_success_clears_it():
    async def scenario(pool: InstancePool) -> None:
        bad = pool.instances[0]
        pool.failed(bad)
        report(pool, 0)                       # one failure: back as soon as it reports again
        assert pool.views()[0].is_healthy
        pool.failed(bad)                      # two in a row: ejected, whatever it reports
        report(pool, 0)
        assert not pool.views()[0].is_healthy
        assert all(pool.pick(RequestView(str(i), 10)) is pool.instances[1] for i in range(4))
        first_s = bad.ejected_until - time.monotonic()
        pool.failed(bad)                      # each further failure doubles the back-off
        assert bad.ejected_until - time.monotonic() > first_s * 1.5
        await asyncio.sleep(0.5)
        report(pool, 0)
        assert pool.views()[0].is_healthy     # the back-off ran out
        pool.succeeded(bad)
        pool.failed(bad)
        report(pool, 0)
        assert pool.views()[0].is_healthy     # the count started again after a success

    run(scenario)


def test_a_refusal_because_it_drains_takes_no_new_work_and_counts_no_failure():
    async def scenario(pool: InstancePool) -> None:
        draining = pool.instances[0]
        for _ in range(3):  # more than eject_after: still no ejection
            pool.failed(draining, DrainingError("draining"))
        assert not pool.views()[0].is_healthy  # no new work until its next report ...
        assert draining.num_failures == 0 and draining.ejected_until == float("-inf")
        report(pool, 0)
        assert pool.views()[0].is_healthy  # ... which, for a real drain, says so

    run(scenario)


def test_a_request_avoids_the_instances_it_failed_on_unless_none_other_is_left():
    async def scenario(pool: InstancePool) -> None:
        first = pool.instances[0].address
        assert all(pool.pick(RequestView(str(i), 10), avoid=[first]) is pool.instances[1] for i in range(4))
        both = [first, pool.instances[1].address]
        assert pool.pick(RequestView("x", 10), avoid=both) in pool.instances

    run(scenario)


def test_ready_means_a_fresh_report_from_one_instance_of_each_needed_role():
    async def main():
        backend = ClusterBackend(("10.0.0.1:1", "10.0.0.2:1"), ("10.0.0.3:1",), ("10.0.0.4:1",))
        try:
            assert not await backend.is_healthy()        # nothing heard yet: not ready
            report(backend.prefills, 0)
            report(backend.decodes, 0)
            assert await backend.is_healthy()            # one prefill down, no encoder: still ready
            report(backend.decodes, 0, age_s=60)         # the only decode stopped reporting
            assert not await backend.is_healthy()
            report(backend.decodes, 0)
            backend.decodes.set_drained(backend.decodes.instances[0], True)
            assert not await backend.is_healthy()        # drained is not serving either
        finally:
            await backend.close()

    asyncio.run(main())


def test_the_admin_api_marks_a_report_that_stopped_coming_as_stale():
    async def main():
        pool = pool_of(2, health_timeout_s=3.0)
        report(pool, 0)
        report(pool, 1, age_s=30)
        pool.failed(pool.instances[1])
        app = create_admin_app({"decode": pool}, "token")
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin") as client:
                reply = await client.get("/admin/instances", headers={"Authorization": "Bearer token"})
            fresh, stale = reply.json()
            assert (fresh["stale"], fresh["healthy"], fresh["failures_in_a_row"]) == (False, True, 0)
            assert (stale["stale"], stale["healthy"], stale["failures_in_a_row"]) == (True, False, 1)
            assert stale["report_age_s"] >= 30 and stale["load"] is not None
        finally:
            await pool.close()

    asyncio.run(main())


def test_the_router_learns_the_model_from_whichever_instance_answers():
    """A router (re)started while its first prefill instance is down still comes up."""
    from services.common.wire import ModelInfo, model_info_to_proto
    from services.launcher import free_port
    from services.pb import decode_pb2_grpc

    class Decode(decode_pb2_grpc.DecodeServicer):
        async def GetModelInfo(self, request, context):
            return model_info_to_proto(ModelInfo(model_name="m", max_model_len=64, vocab_size=10, block_size=16,
                                                 eos_token_ids=(2,), tokenizer_json="", tokenizer_config_json="{}",
                                                 image_token_id=None, hidden_size=8))

    async def main():
        server = grpc.aio.server()
        decode_pb2_grpc.add_DecodeServicer_to_server(Decode(), server)
        live = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        dead = f"127.0.0.1:{free_port('127.0.0.1')}"
        backend = ClusterBackend((dead,), (live,))
        try:
            await asyncio.wait_for(backend.connect(timeout_s=30), 10)
            assert backend.model_name == "m" and backend.max_model_len == 64
        finally:
            await backend.close()
            await server.stop(None)

    asyncio.run(main())


def test_a_frozen_prefill_fails_its_request_at_the_stage_deadline_and_counts_a_failure():
    """A prefill instance that never answers (frozen) must not hold a request forever."""
    from services.common.errors import DeadlineExceededError
    from services.common.sampling_params import SamplingParams
    from services.pb import prefill_pb2_grpc
    from services.router.cluster.backend import GenerateRequest

    class Frozen(prefill_pb2_grpc.PrefillServicer):
        async def Prefill(self, request, context):
            await asyncio.sleep(30)

    async def main():
        server = grpc.aio.server()
        prefill_pb2_grpc.add_PrefillServicer_to_server(Frozen(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        backend = ClusterBackend((f"127.0.0.1:{port}",), ("10.0.0.3:1",), stage_timeout_s=0.3)
        try:
            started = time.monotonic()
            chunks = backend.generate(GenerateRequest("cmpl-1", (1, 2, 3), SamplingParams(max_tokens=4)))
            try:
                await chunks.__anext__()
                raise AssertionError("a frozen prefill answered")
            except DeadlineExceededError:
                pass
            assert time.monotonic() - started < 5
            prefill = backend.prefills.instances[0]
            assert (prefill.num_failures, prefill.num_in_flight) == (1, 0)
        finally:
            await backend.close()
            await server.stop(None)

    asyncio.run(main())
