"""Live membership: the table's diffs, a pool taking instances in and out while it serves, and
the admin API's POST / DELETE /admin/instances."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from services.common.errors import UnavailableError
from services.common.sampling_params import SamplingParams
from services.common.wire import LoadReport
from services.pb import prefill_pb2
from services.router.admin.app import create_admin_app
from services.router.cluster.membership import Change, Member, MembershipTable, StaticDiscovery
from services.router.cluster.backend import GenerateRequest
from services.router.cluster.pipeline import ClusterBackend
from services.router.policies import RequestView, make_policy

A, B, C = "10.0.0.1:5000", "10.0.0.2:5000", "10.0.0.3:5000"
HEADERS = {"Authorization": "Bearer token"}


def kinds(changes: list[Change]) -> list[tuple[str, str, str]]:
    return [(c.kind, c.member.address, c.source) for c in changes]


def test_a_source_publishes_whole_sets_and_the_table_says_what_changed():
    table = MembershipTable()
    assert kinds(table.update("kubernetes", [Member("decode", A), Member("decode", B, is_ready=False)])) == [
        ("join", A, "kubernetes"), ("join", B, "kubernetes")]
    assert table.update("kubernetes", [Member("decode", A), Member("decode", B, is_ready=False)]) == []  # resync
    assert kinds(table.update("kubernetes", [Member("decode", A, is_ready=False), Member("decode", B)])) == [
        ("unready", A, "kubernetes"), ("ready", B, "kubernetes")]
    assert kinds(table.update("kubernetes", [Member("decode", B)])) == [("leave", A, "kubernetes")]
    # a recycled address with another role: the old instance leaves, the new one joins
    assert kinds(table.update("kubernetes", [Member("prefill", B)])) == [
        ("leave", B, "kubernetes"), ("join", B, "kubernetes")]


def test_an_address_belongs_to_the_first_source_and_passes_to_the_next_when_it_lets_go():
    table = MembershipTable()
    table.update("static", [Member("prefill", A)])
    assert table.add("admin", Member("prefill", A)) == []         # static holds it
    assert table.owner(A) == "static"
    assert kinds(table.update("static", [])) == [("leave", A, "static"), ("join", A, "admin")]
    assert table.owner(A) == "admin"
    assert kinds(table.remove("admin", A)) == [("leave", A, "admin")]
    assert table.owner(A) is None


def test_members_are_checked():
    with pytest.raises(ValueError, match="unknown role 'kvstore'"):
        Member("kvstore", A)
    with pytest.raises(ValueError, match="is not host:port"):
        Member("decode", "10.0.0.1")
    assert [m.address for m in StaticDiscovery.of([A], [B], [C]).members] == [A, B, C]


def report(instance, pool, name: str = "") -> None:
    instance.on_report(LoadReport(name or instance.address, pool.role), time.monotonic(), pool.cost)
    pool.dispatch()


def test_a_joining_instance_gets_work_after_its_first_report_and_a_leaving_one_after_its_requests():
    async def main():
        backend = ClusterBackend((A,), (B,))
        pool = backend.decodes
        pool.start_watching()   # as after connect: joiners wait for a report
        try:
            report(pool.instances[0], pool)
            backend.apply(backend.membership.add("admin", Member("decode", C, "decode-new")))
            new = pool.find(C)
            assert new.source == "admin" and new.instance_id == "decode-new"
            assert {pool.pick(RequestView(str(i), 10)).address for i in range(4)} == {B}   # not before a report
            report(new, pool, "decode-new")
            assert {pool.pick(RequestView(str(i), 10)).address for i in range(4)} == {B, C}

            old = pool.find(B)
            with pool.using(old):                     # a request of this router is on it
                [leaving] = backend.apply(backend.membership.remove("static", B))
                assert {pool.pick(RequestView(str(i), 10)).address for i in range(4)} == {C}
                await asyncio.sleep(0.2)
                assert not leaving.done() and old in pool.instances   # drains: still in the pool
            await asyncio.wait_for(leaving, 2)
            assert [i.address for i in pool.instances] == [C]
        finally:
            await backend.close()

    asyncio.run(main())


def test_a_leaving_instance_that_comes_back_stays_and_one_whose_time_is_up_goes():
    async def main():
        backend = ClusterBackend((A,), (B, C), leave_timeout_s=0.3)
        pool = backend.decodes
        try:
            instance = pool.find(B)
            with pool.using(instance):
                [leaving] = backend.apply(backend.membership.remove("static", B))
                backend.apply(backend.membership.add("admin", Member("decode", B)))
                assert not instance.is_leaving and instance.source == "admin"
                await asyncio.wait_for(leaving, 2)
                assert instance in pool.instances                  # it came back: kept
                [leaving] = backend.apply(backend.membership.remove("admin", B))
                await asyncio.wait_for(leaving, 2)                 # 0.3 s, its request still running
                assert instance not in pool.instances
            backend.apply(backend.membership.remove("static", C))
            with pytest.raises(UnavailableError):     # the last one is leaving: nothing to pick
                pool.pick(RequestView("x", 1))
        finally:
            await backend.close()

    asyncio.run(main())


def test_readiness_from_discovery_holds_new_work_and_an_undrain_does_not_override_it():
    async def main():
        backend = ClusterBackend((A,), (B, C))
        pool = backend.decodes
        try:
            backend.apply(backend.membership.update("static", [Member("prefill", A), Member("decode", B),
                                                                Member("decode", C, is_ready=False)]))
            pool.set_drained(pool.find(C), False)
            assert {pool.pick(RequestView(str(i), 10)).address for i in range(4)} == {B}
            backend.apply(backend.membership.update("static", [Member("prefill", A), Member("decode", B),
                                                                Member("decode", C)]))
            assert {pool.pick(RequestView(str(i), 10)).address for i in range(4)} == {B, C}
        finally:
            await backend.close()

    asyncio.run(main())


def test_the_admin_api_adds_and_removes_instances_and_says_where_each_came_from():
    async def main():
        backend = ClusterBackend((A,), (B,))
        backend.apply(backend.membership.update("kubernetes", [Member("decode", "10.0.0.9:5000", "decode-pod")]))
        pools = {"prefill": backend.prefills, "decode": backend.decodes, "encoder": backend.encoders}
        app = create_admin_app(pools, "token", cluster=backend)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin") as client:
                async def post(body):
                    return await client.post("/admin/instances", json=body, headers=HEADERS)

                added = await post({"role": "decode", "address": C, "instance_id": "decode-9", "source": "launcher"})
                assert added.status_code == 201, added.text
                sources = {i["address"]: i["source"] for i in (await client.get(
                    "/admin/instances", headers=HEADERS)).json()}
                assert sources == {A: "static", B: "static", C: "launcher", "10.0.0.9:5000": "kubernetes"}
                for body, status, words in (
                        ({"role": "decode", "address": C}, 409, "already an instance (from launcher)"),
                        ({"role": "decode", "address": "nope"}, 400, "is not host:port"),
                        ({"role": "router", "address": "10.0.0.5:1"}, 400, "unknown role"),
                        ({"role": "decode", "address": "10.0.0.5:1", "source": "kubernetes"}, 400, "source must be")):
                    reply = await post(body)
                    assert reply.status_code == status and words in reply.json()["error"]["message"], reply.text
                kube = await client.delete("/admin/instances/decode-pod", headers=HEADERS)
                assert kube.status_code == 409 and "Kubernetes" in kube.json()["error"]["message"]

                instance = backend.decodes.find(C)
                instance.num_in_flight = 1                   # a request still on it
                waiting = asyncio.ensure_future(client.delete("/admin/instances/decode-9?wait=true", headers=HEADERS))
                await asyncio.sleep(0.3)
                assert not waiting.done() and instance.is_leaving
                instance.num_in_flight = 0
                gone = await asyncio.wait_for(waiting, 2)
                assert gone.status_code == 200 and gone.json()["removed"] is True
                assert C not in {i["address"] for i in (await client.get("/admin/instances", headers=HEADERS)).json()}
                quick = await client.delete(f"/admin/instances/{B}", headers=HEADERS)
                assert quick.status_code == 202 and quick.json()["leaving"] is True
                assert (await client.delete("/admin/instances/10.9.9.9:1", headers=HEADERS)).status_code == 404
        finally:
            await backend.close()

    asyncio.run(main())


class FakePrefill:
    """Answers Prefill with a first token and a KV handle; records the leases released."""

    def __init__(self) -> None:
        self.released: list[str] = []

    async def Prefill(self, message, **kwargs):
        reply = prefill_pb2.PrefillResponse(first_token_id=7)
        reply.kv.lease_id = "lease-1"
        return reply

    async def Release(self, message, **kwargs):
        self.released.append(message.lease_id)
        return prefill_pb2.ReleaseResponse()


def test_a_prefill_holds_the_request_until_its_kv_is_released_also_when_the_client_leaves_before_decode():
    """Closing the stream right after the first token (decoding never started) must still
    release the KV handle at the prefill instance, and only then may that instance leave."""
    async def main():
        backend = ClusterBackend((A,), (B,), policies={"prefill": make_policy("round_robin")})
        prefill = backend.prefills.instances[0]
        prefill.stub = fake = FakePrefill()
        try:
            request = GenerateRequest("cmpl-1", (1, 2, 3), SamplingParams(max_tokens=8))
            chunks = backend.generate(request)
            first = await chunks.__anext__()
            assert first.token_ids == (7,) and prefill.num_in_flight == 1   # decode may still read it
            await chunks.aclose()
            assert fake.released == ["lease-1"] and prefill.num_in_flight == 0
        finally:
            await backend.close()

    asyncio.run(main())
