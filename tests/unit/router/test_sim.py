"""The cluster simulator: exact timings on hand-sized traces, the bound, load scaling, policies."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from services.common.cost_model import DecodeCost, PrefillCost
from services.router.policies.power_of_two import PowerOfTwo
from services.router.policies.prefill_buckets import PrefillBuckets
from services.router.sim.__main__ import main
from services.router.sim.cluster import SimClock, SimConfig, build_policy, simulate
from services.router.sim.experiment import evaluate, prepare
from services.router.sim.instances import SimDecode
from services.router.sim.trace import TraceRequest, load_trace, time_scaled
from services.router.sim.bound import balanced_bound
from services.router.sim.work import Costs, offered_load, offered_work, time_factor

# Prefill: 1 ms per token, nothing else, one step per prompt (budget far above any prompt here).
LINEAR_PREFILL = PrefillCost(a=0.0, b=1e-3, d=0.0)
FLAT_DECODE = DecodeCost(a=0.01, b=0.0, c=0.0)
COSTS = Costs(prefill=LINEAR_PREFILL, decode=FLAT_DECODE, step_budget_s=1e6)


def req(i: int, at_s: float, num_in: int, num_out: int = 1, hash_ids: tuple[int, ...] = ()) -> TraceRequest:
    return TraceRequest(f"r{i}", at_s, num_in, num_out, hash_ids)


def by_id(result):
    return {r.request.request_id: r for r in result.records}


def test_one_request_one_instance_exact_ttft_and_tpot():
    # Prefill 1000 tokens: 1.0 s. Decode 4 tokens after the first: 3 steps of 10 ms.
    result = simulate([req(0, 5.0, 1000, 4)], SimConfig(1, 1, COSTS), "round_robin")
    (record,) = result.records
    assert record.ttft_s == pytest.approx(1.0)
    assert record.finish_s == pytest.approx(6.03)
    assert record.tpot_s == pytest.approx(0.01)
    assert result.prefills[0].busy_s == pytest.approx(1.0)
    assert result.decodes[0].busy_s == pytest.approx(0.03)


def test_prefill_queue_is_first_come_first_served():
    result = simulate([req(0, 0.0, 500), req(1, 0.1, 200)], SimConfig(1, 1, COSTS), "round_robin")
    records = by_id(result)
    assert records["r0"].first_token_s == pytest.approx(0.5)
    assert records["r1"].first_token_s == pytest.approx(0.7)  # waits for r0, then 0.2 s
    assert records["r1"].ttft_s == pytest.approx(0.6)


def test_decode_step_reads_the_growing_kv():
    # a = 1 ms, c = 1 us per KV token; 999 prompt tokens -> steps read 1000, 1001, 1002.
    costs = Costs(prefill=LINEAR_PREFILL, decode=DecodeCost(a=0.001, b=0.0, c=1e-6), step_budget_s=1e6)
    (record,) = simulate([req(0, 0.0, 999, 4)], SimConfig(1, 1, costs), "round_robin").records
    assert record.first_token_s == pytest.approx(0.999)
    assert record.finish_s == pytest.approx(0.999 + 0.002 + 0.002001 + 0.002002)


def test_a_late_request_joins_the_batch_at_the_next_step_boundary():
    # r0: first token at 1.0, then 10 steps of 10 ms -> 1.10. r1 (2 prefills): first token at
    # 1.045, joins at the boundary 1.05, 2 steps -> 1.07.
    requests = [req(0, 0.0, 1000, 11), req(1, 1.025, 20, 3)]
    records = by_id(simulate(requests, SimConfig(2, 1, COSTS), "round_robin"))
    assert records["r0"].finish_s == pytest.approx(1.10)
    assert records["r1"].first_token_s == pytest.approx(1.045)
    assert records["r1"].finish_s == pytest.approx(1.07)


def test_decode_closed_form_matches_step_by_step():
    decode = SimDecode("d", DecodeCost(a=0.002, b=3e-5, c=1e-7), max_batch=8)
    decode.join(req(0, 0.0, 3000, 50), 0.0)
    decode.join(req(1, 0.0, 7000, 50), 0.0)
    steps, kv, expected = 7, 3001 + 7001, 0.0
    for _ in range(steps):
        expected += decode.cost.seconds(2, kv)
        kv += 2
    assert decode.steps_seconds(steps) == pytest.approx(expected)
    assert decode.steps_reaching(expected) == steps
    assert decode.steps_reaching(expected + 1e-9) == steps + 1
    assert decode.steps_done_by(expected - 1e-9) == steps - 1


def test_prefix_hit_only_once_the_blocks_are_stored():
    blocks = (1, 2, 3)  # 3 x 512 tokens; a full hit leaves the last prompt token to compute
    requests = [req(0, 0.0, 1536, hash_ids=blocks), req(1, 0.5, 1536, hash_ids=blocks),
                req(2, 3.0, 1536, hash_ids=blocks)]
    records = by_id(simulate(requests, SimConfig(2, 1, COSTS), "round_robin"))
    assert records["r1"].num_cached == 0  # r0 still computing them
    assert records["r2"].num_cached == 1535
    assert records["r2"].ttft_s == pytest.approx(0.001)


@pytest.mark.parametrize("hits_at, num_cached, first_token_s", [("start", 1535, 1.537), ("arrival", 0, 3.072)])
def test_a_prompt_queued_behind_its_prefix_hits_it_when_looked_up_at_start(hits_at, num_cached, first_token_s):
    blocks = (1, 2, 3)
    requests = [req(0, 0.0, 1536, hash_ids=blocks), req(1, 0.5, 1536, hash_ids=blocks)]
    records = by_id(simulate(requests, SimConfig(1, 1, COSTS, hits_at=hits_at), "round_robin"))
    assert records["r1"].num_cached == num_cached
    assert records["r1"].first_token_s == pytest.approx(first_token_s)


def test_bound_is_even_spread_or_the_latest_request_alone():
    four_at_once = [req(i, 0.0, 1000) for i in range(4)]  # 1 s of prefill each, no decode
    assert balanced_bound(four_at_once, COSTS, 2, 2).makespan_s == pytest.approx(2.0)
    late = [req(0, 0.0, 1000), req(1, 10.0, 1000, 3)]  # r1 alone: 1 s + 2 decode steps
    assert balanced_bound(late, COSTS, 2, 2).makespan_s == pytest.approx(11.02)


def test_a_perfect_spread_reaches_the_bound():
    experiment = prepare([req(i, 0.0, 1000) for i in range(4)], SimConfig(2, 1, COSTS))
    report = evaluate(experiment, "least_requests")
    assert report.makespan_s == pytest.approx(2.0)
    assert report.bound_makespan_s == pytest.approx(2.0)
    assert report.balanced_ratio == pytest.approx(1.0)
    assert report.prefill_utilization == pytest.approx((1.0, 1.0))


def test_load_scales_arrival_gaps_to_the_balanced_capacity():
    requests = [req(i, 2.0 * i, 1000) for i in range(6)]  # 6 s of prefill over a 10 s span
    work = offered_work(requests, COSTS, 1024)
    assert offered_load(requests, work, 2, 1) == pytest.approx(0.3)
    factor = time_factor(requests, work, 2, 1, load=1.5)
    assert factor == pytest.approx(0.2)
    scaled = time_scaled(requests, factor)
    assert [r.arrival_s for r in scaled] == pytest.approx([0.0, 0.4, 0.8, 1.2, 1.6, 2.0])
    assert offered_load(scaled, work, 2, 1) == pytest.approx(1.5)
    assert prepare(requests, SimConfig(2, 1, COSTS), load=1.5).requests == tuple(scaled)


def test_policies_are_the_live_routers_own():
    clock = SimClock()
    assert type(build_policy("prefill_buckets", 0, clock, LINEAR_PREFILL)) is PrefillBuckets
    assert type(build_policy("power_of_two", 0, clock, LINEAR_PREFILL)) is PowerOfTwo


def mixed_trace(num: int) -> list[TraceRequest]:
    return [req(i, 0.01 * i, 200 + (i * 7919) % 3000, 2 + i % 5) for i in range(num)]


def test_a_seed_makes_a_run_repeatable():
    experiment = prepare(mixed_trace(60), SimConfig(4, 2, COSTS))
    first, again = (evaluate(experiment, "power_of_two", seed=7) for _ in range(2))
    assert first == again
    assert evaluate(experiment, "power_of_two", seed=8) != first


def bimodal_trace() -> list[TraceRequest]:
    """Long and short prompts alternating: round robin over two instances stacks every long one
    on the first."""
    return [req(i, 0.1 * i, 2000 if i % 2 == 0 else 100, 2) for i in range(40)]


def test_round_robin_is_worse_than_the_spec_balancers_on_bimodal_lengths():
    experiment = prepare(bimodal_trace(), SimConfig(2, 2, COSTS))
    spec, round_robin = evaluate(experiment, "spec"), evaluate(experiment, "round_robin")
    assert round_robin.imbalance_prefill > 1.5
    assert spec.imbalance_prefill < 1.1
    assert spec.balanced_ratio > 0.9 > round_robin.balanced_ratio + 0.2
    assert spec.ttft_p99_s < round_robin.ttft_p99_s


def test_cli_json_compare_and_plot(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": int(r.arrival_s * 1000), "input_length": r.input_length,
             "output_length": r.output_length, "hash_ids": [i, i + 1000]} for i, r in enumerate(bimodal_trace())]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [r.input_length for r in load_trace(trace, limit=3)] == [2000, 100, 2000]
    png = tmp_path / "util.png"
    assert main(["--trace", str(trace), "--prefill", "2", "--decode", "2", "--json",
                 "--compare", "round_robin,least_requests", "--plot", str(png)]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("policy", "balanced_ratio", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                "throughput_tok_s", "imbalance", "goodput_req_s", "prefill_utilization", "decode_utilization"):
        assert key in figures
    assert figures["policy"] == "spec" and len(figures["prefill_utilization"]) == 2
    assert set(figures["compare"]) == {"round_robin", "least_requests"}
    with Image.open(png) as image:
        assert image.format == "PNG" and image.height > 3 * 100


def test_cli_rejects_an_unknown_policy(tmp_path, capsys):
    assert main(["--trace", str(tmp_path / "none.jsonl"), "--policy", "nope"]) == 2
    assert "unknown policy" in capsys.readouterr().err
