"""Late binding: requests wait at the router, one queue per prefill bucket, until an instance of
their bucket has room; the queues themselves, the policy's exact dispatches, the live pool's
waiting, leaving and failing, and the simulator running the same code."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from services.common.errors import UnavailableError
from services.common.wire import LoadReport
from services.router.admin.app import create_admin_app
from services.router.cluster.instances import InstancePool
from services.router.policies import InstanceView, Pick, RequestView, make_policy
from services.router.policies.prefill_buckets import PrefillBuckets
from services.router.policies.waiting import Waiting, dispatched
from services.router.sim.cluster import SimConfig, simulate
from services.router.sim.trace import TraceRequest
from tests.unit.router.test_policies import BOUNDS, FakeClock, inst, req, route
from tests.unit.router.test_sim import COSTS


def test_waiting_is_fifo_per_queue_and_oldest_first_across_queues():
    waiting: Waiting[str] = Waiting()
    waiting.add(2, req(5_000, "a"), "A")
    waiting.add(0, req(50, "b"), "B")
    waiting.add(2, req(5_000, "c"), "C")
    assert [(q, r.request_id) for q, r in waiting.heads()] == [(2, "a"), (0, "b")]
    assert waiting.sizes() == {0: 1, 2: 2} and len(waiting) == 3
    assert waiting.pop(2) == (req(5_000, "a"), "A")
    assert [(q, r.request_id) for q, r in waiting.heads()] == [(0, "b"), (2, "c")]
    assert waiting.remove("B") and not waiting.remove("B")
    assert waiting.drain() == ["C"] and len(waiting) == 0 and waiting.heads() == []


def buckets_one_round_in(room_s: float = 0.0) -> PrefillBuckets:
    """Bucket 0 (< 100 tokens) has p0; bucket 2 (1,000-10,000) has p1, p2, p3."""
    clock = FakeClock()
    policy = PrefillBuckets(bounds=BOUNDS, round_s=1.0, room_s=room_s, clock=clock)
    route(policy, req(50), fleet())
    route(policy, req(5_000), fleet())
    clock.now = 1.0
    policy.pick(req(50), fleet())
    assert policy.allocation == {0: ("p0",), 1: (), 2: ("p1", "p2", "p3"), 3: ()}
    return policy


def fleet(**loads: float) -> list[InstanceView]:
    return [inst(f"p{i}", queued_compute_s=loads.get(f"p{i}", 0.0)) for i in range(4)]


def test_dispatch_sends_a_head_to_its_own_bucket_then_borrows_only_from_buckets_nobody_waits_for():
    policy = buckets_one_round_in(room_s=0.1)
    busy = fleet(p1=1.0, p2=0.5, p3=2.0)
    # Bucket 2's head is older but its instances are all busy; p0 stays with bucket 0's head.
    queue, pick = policy.dispatch([(2, req(5_000, "long")), (0, req(50, "short"))], busy)
    assert (queue, pick) == (0, Pick("p0", 0.0, {"bucket": 0.0, "queued_compute_s": 0.0, "requests": 0.0,
                                                 "borrowed": 0.0}))
    # With nobody waiting for bucket 0, its idle instance takes the long prompt (work-conserving).
    queue, pick = policy.dispatch([(2, req(5_000, "long"))], busy)
    assert (queue, pick.instance_id, pick.breakdown["borrowed"]) == (2, "p0", 1.0)
    # Room is queued compute <= room_s: p2 at 0.1 s has it, and is its bucket's least loaded.
    queue, pick = policy.dispatch([(2, req(5_000, "long"))], fleet(p0=0.3, p1=1.0, p2=0.1, p3=0.1))
    assert (queue, pick.instance_id, pick.breakdown["borrowed"]) == (2, "p2", 0.0)


def test_dispatch_holds_when_no_instance_has_room_and_says_when_to_ask_again():
    policy = buckets_one_round_in(room_s=0.1)
    loads = fleet(p0=0.4, p1=1.0, p2=0.35, p3=2.0)
    assert policy.dispatch([(0, req(50)), (2, req(5_000))], loads) is None
    assert policy.wake_after_s(loads) == pytest.approx(0.25)   # p2 drains to 0.1 s first
    assert policy.dispatch([], fleet()) is None
    assert policy.wake_after_s([inst("p0", is_healthy=False)]) is None


def test_before_the_first_round_any_instance_with_room_takes_the_oldest_request():
    policy = PrefillBuckets(bounds=BOUNDS, round_s=10.0, room_s=0.0, clock=FakeClock())
    queue, pick = policy.dispatch([(3, req(20_000, "old")), (0, req(50, "new"))], fleet(p0=0.2, p1=0.2, p3=0.2))
    assert (queue, pick.instance_id, pick.breakdown["borrowed"]) == (3, "p2", 1.0)


def test_demand_is_counted_at_arrival_even_while_requests_wait():
    clock = FakeClock()
    policy = PrefillBuckets(bounds=BOUNDS, round_s=1.0, clock=clock)
    for i in range(3):
        policy.on_arrival(req(5_000, f"r{i}"))    # none dispatched: the fleet is busy
    clock.now = 1.0
    policy.on_arrival(req(50))
    assert policy.last_demand_s[2] == pytest.approx(3 * policy._cost.prompt_seconds(5_000))


def test_a_bucket_that_fell_behind_is_divided_for_its_backlog_too():
    clock = FakeClock()
    policy = PrefillBuckets(bounds=BOUNDS, round_s=1.0, room_s=0.0, clock=clock)
    shorts = [req(50, f"s{i}") for i in range(4)]
    longs = [req(5_000, f"l{i}") for i in range(4)]
    for request in shorts + longs:
        policy.on_arrival(request)
    for request in shorts + longs[:1]:                # three long prompts still wait at the router
        policy.on_pick(request, Pick("p0"))
    policy.on_leave(req(50, "gone"))                   # never arrived: nothing to forget
    clock.now = 1.0
    eight = [inst(f"p{i}") for i in range(8)]
    assert policy.dispatch([(2, longs[1])], eight)[0] == 2
    short_s, long_s = (policy._cost.prompt_seconds(n) for n in (50, 5_000))
    assert policy.last_demand_s == pytest.approx((4 * short_s, 0.0, 4 * long_s, 0.0))
    assert policy.last_backlog_s == pytest.approx((0.0, 0.0, 3 * long_s, 0.0))
    # Divided by demand + backlog (0.094 s vs 0.543 s): 1 and 7. By demand alone (0.094 vs 0.310)
    # it would be 2 and 6, and the long prompts' bucket would stay as far behind.
    assert [len(policy.allocation[b]) for b in range(4)] == [1, 0, 7, 0]


def test_dispatched_sends_until_the_policy_holds_and_reports_each_pick():
    policy = buckets_one_round_in(room_s=0.0)
    loads = {f"p{i}": 0.0 for i in range(4)}
    waiting: Waiting[str] = Waiting()
    for i in range(5):
        waiting.add(2, req(5_000, f"r{i}"), f"item{i}")
    sent = []
    for request, pick, item in dispatched(policy, waiting, lambda: fleet(**loads)):
        loads[pick.instance_id] += 1.0          # what sending it does to the next snapshot
        sent.append((item, pick.instance_id))
    # Bucket 2's three instances, then p0, which bucket 0 (nobody waiting) lends; one still waits.
    assert sent == [("item0", "p1"), ("item1", "p2"), ("item2", "p3"), ("item3", "p0")]
    assert waiting.sizes() == {2: 1}


# ----- the live router's pool ----------------------------------------------------------------------
def with_pool(scenario: Callable[[InstancePool], Awaitable[None]], num: int = 2, room_s: float = 0.0) -> None:
    """Runs ``scenario`` on a pool of ``num`` prefill instances (never connected) under the
    prefill buckets with one pooled round and ``room_s``; the pool is closed after."""
    async def main() -> None:
        pool = InstancePool("prefill", tuple(f"10.0.0.{i}:1" for i in range(num)), lambda channel: None,
                            PrefillBuckets(bounds=BOUNDS, round_s=10.0, room_s=room_s))
        try:
            await scenario(pool)
        finally:
            await pool.close()

    asyncio.run(main())


def test_the_pool_holds_requests_until_a_release_or_report_makes_room():
    async def scenario(pool: InstancePool) -> None:
        first = await pool.place(RequestView("a", 500))
        second = await pool.place(RequestView("b", 500))
        assert {first.instance.address, second.instance.address} == {"10.0.0.0:1", "10.0.0.1:1"}
        third = asyncio.ensure_future(pool.place(RequestView("c", 500)))
        await asyncio.sleep(0.01)
        assert not third.done() and pool.waiting.sizes() == {1: 1}   # 100 <= 500 < 1,000
        pool.release(first)                    # a's prefill returned: its instance has room
        assert (await asyncio.wait_for(third, 5)).instance is first.instance
        # A report that no longer shows b's work makes room too.
        fourth = asyncio.ensure_future(pool.place(RequestView("d", 500)))
        await asyncio.sleep(0.01)
        assert not fourth.done()
        second.instance.on_report(LoadReport("p1", "prefill"), time.monotonic(), pool.cost)
        pool.dispatch()
        assert (await asyncio.wait_for(fourth, 5)).instance is second.instance
        # b's release after that report uncounts nothing twice: p1 stays at what d costs.
        pool.release(second)
        assert second.instance.num_sent == 1 and second.instance.done_s == pytest.approx(second.compute_s)

    with_pool(scenario)


def test_a_request_that_leaves_while_queued_takes_nothing_with_it():
    async def scenario(pool: InstancePool) -> None:
        held = await pool.place(RequestView("a", 500))
        leaving = asyncio.ensure_future(pool.place(RequestView("b", 500)))
        await asyncio.sleep(0.01)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert len(pool.waiting) == 0 and pool.policy._unplaced == {}   # out of the backlog too
        pool.release(held)
        instance = held.instance
        assert (instance.num_sent, instance.sent_s) == (0, 0.0)

    with_pool(scenario, num=1)


def test_the_policys_wake_up_dispatches_with_no_event_at_all():
    async def scenario(pool: InstancePool) -> None:
        (instance,) = pool.instances
        instance.on_report(LoadReport("p0", "prefill", queued_prefill_compute_s=0.3), time.monotonic(), pool.cost)
        started = time.monotonic()
        placed = await asyncio.wait_for(pool.place(RequestView("a", 50)), 5)
        # Reported 0.3 s of work drains to the 0.1 s of room after ~0.2 s.
        assert placed.instance is instance and time.monotonic() - started >= 0.15

    with_pool(scenario, num=1, room_s=0.1)


def test_waiting_requests_fail_as_unavailable_once_no_instance_is_left_and_move_on_a_policy_switch():
    async def scenario(pool: InstancePool) -> None:
        held = [await pool.place(RequestView(f"h{i}", 500)) for i in range(2)]
        doomed = asyncio.ensure_future(pool.place(RequestView("x", 500)))
        await asyncio.sleep(0.01)
        for instance in pool.instances:
            pool.set_drained(instance, True)
        with pytest.raises(UnavailableError, match="no prefill instance is available"):
            await asyncio.wait_for(doomed, 5)
        assert len(pool.waiting) == 0 and pool.policy._unplaced == {}
        pool.set_drained(pool.instances[0], False)
        moved = asyncio.ensure_future(pool.place(RequestView("y", 500)))
        await asyncio.sleep(0.01)
        assert not moved.done()
        pool.set_policy(make_policy("round_robin"))   # not queueing: placed at once
        assert (await asyncio.wait_for(moved, 5)).instance is pool.instances[0]
        for placement in held:
            pool.release(placement)

    with_pool(scenario)


def test_what_the_router_sent_is_priced_at_the_instances_own_speed():
    async def scenario(pool: InstancePool) -> None:
        slow, fast = pool.instances
        # slow's fitted model prices its 1,000 queued tokens at 3 s, 88x the reference card's.
        slow.on_report(LoadReport("p0", "prefill", num_queued_prefill_tokens=1_000, queued_prefill_compute_s=3.0),
                       time.monotonic(), pool.cost)
        assert slow.cost_scale == pytest.approx(3.0 / pool.cost.seconds(1_000))
        assert fast.cost_scale == 1.0
        placed = await pool.place(RequestView("a", 500))     # fast: nothing queued
        assert placed.instance is fast and placed.compute_s == pytest.approx(pool.cost.prompt_seconds(500))
        pool.release(placed)
        fast.is_drained = True
        placed = await asyncio.wait_for(pool.place(RequestView("b", 500)), 5)   # slow: 3 s is within its room
        assert placed.compute_s == pytest.approx(slow.cost_scale * pool.cost.prompt_seconds(500))
        assert slow.sent_s == pytest.approx(placed.compute_s)

    with_pool(scenario, room_s=3.0)


def test_the_admin_api_shows_and_sets_the_room_and_what_waits():
    async def scenario(pool: InstancePool) -> None:
        held = [await pool.place(RequestView(f"h{i}", 500)) for i in range(2)]
        waiting = asyncio.ensure_future(pool.place(RequestView("w", 5_000)))
        await asyncio.sleep(0.01)
        app = create_admin_app({"prefill": pool}, "t0ken")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin",
                                     headers={"Authorization": "Bearer t0ken"}) as client:
            body = (await client.get("/admin/prefill/buckets")).json()
            assert (body["room_s"], body["waiting"]) == (0.0, {"2": 1})
            bad = await client.put("/admin/prefill/buckets", json={"room_s": -1})
            assert bad.status_code == 400 and "room_s" in bad.json()["error"]["message"]
            # New bounds re-queue what waits: 5,000 tokens is now bucket 3.
            moved = await client.put("/admin/prefill/buckets", json={"bounds": [10, 20, 30]})
            assert moved.json()["waiting"] == {"3": 1}
            # More room lets it start at once (each instance has ~28 ms of reference compute queued).
            roomy = await client.put("/admin/prefill/buckets", json={"room_s": 0.5})
            assert roomy.json()["room_s"] == 0.5 and roomy.json()["waiting"] == {}
            assert (await asyncio.wait_for(waiting, 5)).instance in pool.instances
            await client.put("/admin/policies/prefill", json={"policy": "round_robin"})
            no_buckets = await client.get("/admin/prefill/buckets")
            assert no_buckets.status_code == 409 and "round_robin" in no_buckets.json()["error"]["message"]
        for placement in held:
            pool.release(placement)

    with_pool(scenario)


# ----- the simulator ---------------------------------------------------------------------------------
def test_the_simulated_router_queues_too_and_the_buckets_divide_the_fleet():
    # Prefill 1 ms/token. Round 1 asks 2 s of bucket 2 and 0.05 s of bucket 0, so the next round
    # gives bucket 2 four of the five instances and bucket 0 one.
    requests = [TraceRequest("s0", 0.0, 50, 1), TraceRequest("l0", 0.0, 2_000, 1)]
    requests += [TraceRequest(f"l{i}", 3.0, 5_000, 1) for i in range(1, 7)]
    requests += [TraceRequest("s1", 3.1, 50, 1)]
    result = simulate(requests, SimConfig(5, 1, COSTS), configure={"bounds": BOUNDS, "round_s": 1.0, "room_s": 0.0})
    assert result.prefill_policy.allocation == {0: ("prefill-0",), 1: (), 2: tuple(f"prefill-{i}" for i in range(1, 5)),
                                                3: ()}
    records = {r.request.request_id: r for r in result.records}
    # l1-l4 take bucket 2's instances, l5 borrows idle prefill-0 (nobody waits for bucket 0),
    # l6 waits at the router for the first of them to finish (5 s of prefill each).
    assert [records[f"l{i}"].prefill_id for i in range(1, 6)] == [f"prefill-{i}" for i in (1, 2, 3, 4, 0)]
    assert [records[f"l{i}"].first_token_s for i in range(1, 7)] == pytest.approx([8.0] * 5 + [13.0])
    # The short prompt at 3.1 s waits too, in its own queue, and takes its bucket's instance as
    # soon as it is free, not behind l6.
    assert records["s1"].prefill_id == "prefill-0" and records["s1"].first_token_s == pytest.approx(8.05)
