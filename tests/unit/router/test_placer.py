"""The placement core shared by the live router and the simulator: the load estimate between
reports, the queues, dispatch, wake-ups and health, on a fake clock; and the simulator seeing
the instances through it, as the live router does."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.cost_model import PrefillCost
from services.common.wire import LoadReport
from services.router.cluster.instances import InstancePool
from services.router.policies import POLICIES, QueueingPolicy, RequestView, make_policy
from services.router.policies.estimate import LoadEstimate
from services.router.policies.placer import Placer
from services.router.policies.prefill_buckets import PrefillBuckets
from services.router.sim.cluster import SimConfig, simulate
from services.router.sim.trace import TraceRequest
from tests.unit.router.test_policies import BOUNDS, FakeClock
from tests.unit.router.test_sim import COSTS

COST = PrefillCost()
ROOT = Path(__file__).resolve().parents[3]


def placer_of(num: int, policy, clock: FakeClock) -> Placer[str, LoadEstimate]:
    return Placer("prefill", [LoadEstimate(f"p{i}") for i in range(num)], policy, clock, cost=COST)


def test_the_estimate_drains_the_report_and_counts_what_was_sent_since():
    estimate = LoadEstimate("p0")
    estimate.on_report(LoadReport("p0", "prefill", num_waiting=2, queued_prefill_compute_s=1.0), 10.0, COST)
    assert estimate.view("prefill", 10.25, 3.0, COST).queued_compute_s == pytest.approx(0.75)
    sent_at = estimate.on_sent(0.5)
    view = estimate.view("prefill", 10.25, 3.0, COST)
    assert (view.num_waiting, view.queued_compute_s) == (3, pytest.approx(1.25))
    estimate.on_done(0.5, sent_at)                      # no report counted it: uncounted
    assert (estimate.num_sent, estimate.sent_s) == (0, 0.0)
    sent_at = estimate.on_sent(0.5)
    estimate.on_report(LoadReport("p0", "prefill", queued_prefill_compute_s=2.0), 11.0, COST)
    estimate.on_done(0.5, sent_at)                      # the report counted it: what it said drains by it
    assert estimate.view("prefill", 11.1, 3.0, COST).queued_compute_s == pytest.approx(1.5)
    assert estimate.view("prefill", 13.5, 3.0, COST).queued_compute_s == 0.0
    # Its own model prices its queue at 3x the reference: so does the router what it sends.
    estimate.on_report(LoadReport("p0", "prefill", num_queued_prefill_tokens=1_000,
                                  queued_prefill_compute_s=3 * COST.seconds(1_000)), 14.0, COST)
    assert estimate.cost_scale == pytest.approx(3.0)


def test_a_queueing_policy_holds_a_request_until_its_instance_drains_to_room():
    clock = FakeClock()
    placer = placer_of(1, PrefillBuckets(bounds=BOUNDS, round_s=10.0, room_s=0.1, clock=clock), clock)
    (p0,) = placer.instances
    placer.on_report(p0, LoadReport("p0", "prefill", queued_prefill_compute_s=0.3))
    held = placer.place(RequestView("a", 50), "A")
    assert (held.started, held.failed, held.wake_after_s) == ([], [], pytest.approx(0.2))
    assert placer.waiting.sizes() == {0: 1}
    clock.now = 0.2
    ((item, placement),) = placer.dispatch().started
    assert (item, placement.instance, placement.compute_s) == ("A", p0, pytest.approx(COST.prompt_seconds(50)))
    view = placer.views()[0]    # the same instant: the send shows at once
    assert (view.num_waiting, view.queued_compute_s) == (1, pytest.approx(0.1 + placement.compute_s))
    placer.release(placement)
    assert placer.views()[0].queued_compute_s == pytest.approx(0.1)


def test_any_other_policy_places_at_once_and_with_nothing_available_what_waits_fails():
    clock = FakeClock()
    placer = placer_of(2, make_policy("round_robin"), clock)
    ((item, placement),) = placer.place(RequestView("a", 10), "A").started
    assert (item, placement.instance.address, placer.picks["round_robin"]) == ("A", "p0", 1)
    for instance in placer.instances:
        placer.mark_unavailable(instance)
    outcome = placer.place(RequestView("b", 10), "B")
    assert (outcome.started, outcome.failed, len(placer.waiting)) == ([], ["B"], 0)
    assert placer.pick(RequestView("c", 10)) is None


def test_ejection_follows_the_injected_clock():
    clock = FakeClock()
    placer = placer_of(1, make_policy("round_robin"), clock)
    (p0,) = placer.instances
    assert [placer.failed(p0) for _ in range(4)] == [None, None, 1.0, 2.0]
    placer.on_report(p0, LoadReport("p0", "prefill"))
    assert not placer.views()[0].is_healthy           # ejected whatever it reports
    clock.now = 2.0
    assert placer.views()[0].is_healthy and placer.num_serving() == 1
    placer.failed(p0)
    placer.succeeded(p0)                               # a success clears the ejection
    placer.on_report(p0, LoadReport("p0", "prefill"))
    assert placer.views()[0].is_healthy


def test_only_the_prefill_buckets_queue():
    queueing = [name for name in sorted(POLICIES) if isinstance(make_policy(name), QueueingPolicy)]
    assert queueing == ["prefill_buckets"]
    assert not hasattr(make_policy("round_robin"), "queue_of")


def test_the_live_pool_is_the_core_plus_grpc():
    async def main() -> None:
        pool = InstancePool("decode", ("10.0.0.1:1",), lambda channel: None, make_policy("round_robin"))
        try:
            assert isinstance(pool.placer, Placer) and pool.instances is pool.placer.instances
            assert isinstance(pool.instances[0], LoadEstimate) and pool.instances[0].stub is None
        finally:
            await pool.close()

    asyncio.run(main())


@pytest.mark.parametrize("interval_s, decode_id", [(10.0, "decode-1"), (0.05, "decode-0")])
def test_the_simulated_router_sees_load_reports_not_the_instances_themselves(interval_s, decode_id):
    # r0's decode is over at 0.11 s. With reports 10 s apart the router still counts it on
    # decode-0 when r1 comes (decodes are never released: only a report uncounts them), so
    # least requests sends r1 to decode-1; with reports every 50 ms it knows decode-0 is idle.
    requests = [TraceRequest("r0", 0.0, 100, 2), TraceRequest("r1", 1.0, 100, 2)]
    config = SimConfig(2, 2, COSTS, report_interval_s=interval_s)
    records = {r.request.request_id: r for r in simulate(requests, config, "least_requests").records}
    assert records["r0"].decode_id == "decode-0" and records["r1"].decode_id == decode_id


def test_the_core_loads_no_grpc_protobuf_or_asyncio():
    code = ("import sys, services.router.policies.placer; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'grpc', 'google', 'asyncio'}))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
