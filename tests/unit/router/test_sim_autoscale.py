"""The simulator scaled by the planner's own core: instances that start late and drain before
they leave, replicas following a load that rises and falls, instance-seconds, the CLI."""

from __future__ import annotations

import json
import math

import pytest

from services.router.planner import Decision, Planner, PlannerConfig, RoleLimits, Signals
from services.router.sim.__main__ import main
from services.router.sim.cluster import SimConfig, simulate
from services.router.sim.report import Slo, build_report
from services.router.sim.scaling import Scaler, instance_seconds, scaled_config
from services.router.sim.trace import Phase, TraceRequest, phased
from tests.unit.router.test_sim import COSTS, req

# Every prompt 200 tokens: 0.2 s of prefill (COSTS: 1 ms a token); 3 output tokens.
SOURCE = [TraceRequest(f"s{i}", 0.0, 200, 3, (i,)) for i in range(50)]
PLANNER = PlannerConfig(interval_s=1.0, prefill_sqrt_headroom=0.0, scale_up_window_s=1.0, scale_down_window_s=5.0,
                        forecast_lead_s=2.0, trend_window_s=4.0, backlog_drain_s=5.0,
                        roles={"prefill": RoleLimits(1, 8), "decode": RoleLimits(1, 1)})
CONFIG = SimConfig(1, 1, COSTS, startup_s=2.0, report_interval_s=0.1)


def rising_then_falling() -> list[TraceRequest]:
    """2 req/s (0.4 instances' worth), 20 req/s for 20 s (4), then 2 req/s again."""
    return phased(SOURCE, [Phase(20, 2.0), Phase(20, 20.0), Phase(40, 2.0)], ramp_s=0.0, seed=3)


def run(requests: list[TraceRequest], observer, config: SimConfig = CONFIG):
    scaler = Scaler(observer, 1.0)
    result = simulate(requests, config, configure={"round_s": 1.0}, scaler=scaler)
    return result, build_report("spec", result, requests[0].arrival_s, 0.0, 1.0, 1.0, 0.0, True, Slo())


def test_replicas_follow_a_load_that_rises_then_falls():
    requests = rising_then_falling()
    result, report = run(requests, Planner(PLANNER))
    prefill = [counts["prefill"] for _, counts in result.replicas]
    peak = prefill.index(max(prefill))
    assert prefill[0] == 1 and max(prefill) >= 5 and prefill[-1] <= 2
    assert 20 <= result.replicas[peak][0] <= 45         # up in the surge
    assert prefill[peak:] == sorted(prefill[peak:], reverse=True)   # then down, one step at a time
    assert all(b - a >= -1 for a, b in zip(prefill[peak:], prefill[peak + 1:]))
    # Every request finished, on the instances that existed, removed ones included.
    assert len(result.records) == len(requests) and not any(math.isnan(r.finish_s) for r in result.records)
    removed = [p for p in result.prefills if p.life.removed_at is not None]
    assert removed and all(p.is_idle for p in removed)
    # Cheaper than the largest fleet it had, for the whole run.
    assert report.instance_s < (report.max_prefill + report.max_decode) * report.makespan_s
    assert report.instance_s_prefill == pytest.approx(instance_seconds(result.prefills, requests[0].arrival_s,
                                                                       requests[0].arrival_s + report.makespan_s))
    assert report.replicas[0][1:] == (1, 1) and report.max_prefill == max(prefill)
    assert report.slo_attainment > 0.9


def test_an_autoscaled_run_is_deterministic():
    requests = rising_then_falling()
    assert run(requests, Planner(PLANNER))[1] == run(requests, Planner(PLANNER))[1]


class Script:
    """Scripted decisions: at each time given, that many replicas per role."""

    def __init__(self, plan: dict[float, dict[str, int]]) -> None:
        self.plan = plan

    def observe(self, signals: Signals) -> dict[str, Decision]:
        wanted = self.plan.get(round(signals.at, 6), {})
        return {role: Decision(role, s.num_replicas, wanted.get(role, s.num_replicas), "script")
                for role, s in signals.roles.items()}


def test_a_started_instance_serves_only_after_its_start_up():
    requests = [req(i, 0.5 * i, 1000) for i in range(12)]       # 1 s of prefill every 0.5 s
    result, report = run(requests, Script({1.0: {"prefill": 2}}))
    started = [r for r in result.records if r.prefill_id == "prefill-1"]
    assert started and min(r.first_token_s - r.prefill_s for r in started) >= 3.0   # 1 s + 2 s start-up
    new = result.prefills[1]
    assert new.life.started_at == 1.0 and new.life.removed_at is None
    end = report.makespan_s
    assert report.instance_s_prefill == pytest.approx(end + (end - 1.0))   # its start-up costs too


def test_a_retired_instance_drains_its_work_then_leaves():
    requests = [req(i, 0.0, 1000) for i in range(6)] + [req(6, 4.0, 100)]
    result, _ = run(requests, Script({1.0: {"prefill": 1}}), SimConfig(2, 1, COSTS, report_interval_s=0.1))
    retired = next(p for p in result.prefills if p.life.removed_at is not None)
    served = [r for r in result.records if r.prefill_id == retired.instance_id]
    assert served and retired.life.removed_at == pytest.approx(max(r.first_token_s for r in served))
    assert all(not math.isnan(r.finish_s) for r in result.records)
    assert {r.prefill_id for r in result.records if r.request.arrival_s >= 1.0} != {retired.instance_id}


def test_a_still_starting_instance_is_retired_first_and_at_once():
    requests = [req(i, 0.5 * i, 200) for i in range(20)]
    result, report = run(requests, Script({1.0: {"prefill": 3}, 2.0: {"prefill": 2}}))
    newest = result.prefills[2]
    assert (newest.life.started_at, newest.life.removed_at) == (1.0, 2.0)
    assert report.replicas[2][1] == 2 and not any(r.prefill_id == "prefill-2" for r in result.records)


def test_the_planner_clocks_scale_with_the_trace():
    config = scaled_config(PLANNER, 0.5)
    assert (config.interval_s, config.scale_down_window_s, config.forecast_lead_s) == (0.5, 2.5, 1.0)
    assert config.ttft_s == PLANNER.ttft_s


def test_cli_autoscale_json(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": round(r.arrival_s * 1000), "input_length": r.input_length,
                                         "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                             for r in rising_then_falling()))
    settings = tmp_path / "planner.json"
    settings.write_text(json.dumps({**{k: v for k, v in PLANNER.to_dict().items() if k != "decode_cost"},
                                    "interval_s": 1.0}))
    assert main(["--trace", str(trace), "--autoscale", "--planner-config", str(settings), "--startup-s", "2",
                 "--round-s", "1", "--report-interval-s", "0.1", "--json"]) == 0
    out = capsys.readouterr().out
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["policy"] == "spec autoscaled" and "instance-seconds (GPU-seconds" in out
    assert figures["max_prefill"] > 1 and figures["replicas"][0][1:] == [1, 1]
    assert figures["instance_s"] == pytest.approx(figures["instance_s_prefill"] + figures["instance_s_decode"])


def test_cli_rejects_a_planner_config_the_simulator_cannot_run(tmp_path, capsys):
    settings = tmp_path / "planner.json"
    settings.write_text(json.dumps({"roles": {"prefill": {"min_replicas": 0, "max_replicas": 4}}}))
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 2}) + "\n")
    assert main(["--trace", str(trace), "--autoscale", "--planner-config", str(settings)]) == 2
    assert "roles.prefill.min_replicas: the simulator needs >= 1" in capsys.readouterr().err
