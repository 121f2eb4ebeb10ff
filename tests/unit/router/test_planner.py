"""The planner's pure core on recorded signal series, with exact decisions; its config; and the
signals read off the placement core."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from services.common.cost_model import PrefillCost
from services.common.wire import LoadReport
from services.router.planner import Planner, PlannerConfig, RoleLimits, RoleSignals, Signals, signals_from
from services.router.planner.core import fit_trend
from services.router.policies.decode_balance import DecodeBalance
from services.router.policies.estimate import LoadEstimate
from services.router.policies.placer import Placer
from services.router.policies.base import RequestView
from services.router.policies.prefill_buckets import PrefillBuckets

# No smoothing, no square-root headroom, half-busy instances: a prefill demand of R reference
# seconds per second at speed 1 needs exactly ceil(2 R) instances.
EXACT = PlannerConfig(interval_s=10.0, prefill_utilization_target=0.5, prefill_sqrt_headroom=0.0,
                      trend_window_s=0.0, scale_up_window_s=10.0, scale_down_window_s=60.0,
                      roles={"prefill": RoleLimits(1, 10), "decode": RoleLimits(1, 10)})


def prefill(replicas: int, demand: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0), backlog_s: float = 0.0,
            ready: int | None = None, speed: float = 1.0) -> RoleSignals:
    """Prefill signals over a 10 s round: ``demand`` seconds of compute per bucket."""
    return RoleSignals(replicas, replicas if ready is None else ready, demand_s=demand,
                       backlog_s=(backlog_s, 0.0, 0.0, 0.0), period_s=10.0, queued_s=0.0, speed=speed)


def decode(replicas: int, running: int, kv_tokens: int, kv_capacity: int = 1_000_000) -> RoleSignals:
    return RoleSignals(replicas, replicas, num_running=running, kv_tokens=kv_tokens, kv_capacity_tokens=kv_capacity)


def replay(planner: Planner, role: str, series: list[RoleSignals], start: int | None = None,
           first_at: float = 0.0, interval: float = 10.0) -> list[int]:
    """Desired counts over ``series`` (one every ``interval`` from ``first_at``), each instant's
    replicas being the last decision's (an actuator that follows at once); ``start``: the
    replicas at first."""
    desired, current = [], start if start is not None else series[0].num_replicas
    for k, signals in enumerate(series):
        signals = dataclasses.replace(signals, num_replicas=current, num_ready=current)
        decision = planner.observe(Signals(first_at + k * interval, {role: signals}))[role]
        assert decision.current == current
        current = decision.desired
        desired.append(current)
    return desired


def changes(counts: list[int], start: int) -> int:
    return sum(1 for a, b in zip([start] + counts, counts) if a != b)


# ----- the rules ---------------------------------------------------------------------------------
def test_prefill_scales_up_when_long_prompts_surge():
    planner = Planner(EXACT)
    short = (10.0, 0.0, 0.0, 0.0)              # 1 s/s, all short prompts: 2 instances
    surge = (10.0, 20.0, 10.0, 0.0)            # + 3 s/s of long prompts: 8 instances
    assert replay(planner, "prefill", [prefill(2, short)] * 3 + [prefill(2, surge)] * 2) == [2, 2, 2, 2, 8]
    decision = planner.history[-1]
    assert (decision["at"], decision["current"], decision["desired"]) == (40.0, 2, 8)
    assert decision["reason"] == ("prefill demand 4.00 s/s (50% in bucket 1) + backlog 0.0 s over 30 s "
                                  "needs 8 (8 now) at 0.5 utilization; up from 2")
    assert decision["inputs"]["bucket1_demand_s_per_s"] == 2.0
    assert decision["inputs"]["bucket2_demand_s_per_s"] == 1.0


def test_prefill_counts_the_backlog_and_the_instances_speed():
    planner = Planner(EXACT)
    # 1 s/s at speed 0.5 is 2 instances' worth -> 4; a 3 s backlog over 30 s at speed 0.5 -> +0.2
    # (and waits 1.5 s on 4 instances: within the TTFT, so the scale-up window applies).
    assert replay(planner, "prefill", [prefill(4, (10.0, 0, 0, 0), backlog_s=3.0, speed=0.5)] * 2) == [4, 5]


def test_a_missed_ttft_skips_the_scale_up_window():
    planner = Planner(dataclasses.replace(EXACT, scale_up_window_s=60.0))
    # 12 s of backlog on 2 instances waits 6 s > the 2 s TTFT: up at once to 2 + 12 / 30 -> 3.
    decisions = replay(planner, "prefill", [prefill(2, (10.0, 0, 0, 0), backlog_s=12.0)])
    assert decisions == [3]
    assert planner.history[-1]["reason"].endswith("up from 2 at once: an SLO is being missed")


def test_decode_scales_up_when_kv_use_passes_its_target():
    planner = Planner(EXACT)
    # 1M tokens per instance at a 0.7 target: 1.2M in use fits 2 instances, 1.6M needs 3.
    series = [decode(2, 100, 1_200_000)] * 2 + [decode(2, 100, 1_600_000)] * 3
    assert replay(planner, "decode", series) == [2, 2, 2, 3, 3]
    assert planner.history[-1]["reason"].startswith("decode KV 1600K tokens of 1000K per instance needs 3")


def test_decode_scales_with_running_requests_against_the_tpot_target():
    config = dataclasses.replace(EXACT, tpot_s=0.0055)   # (5.5 - 2.8) ms / 26 us: 103 per step
    planner = Planner(config)
    assert replay(planner, "decode", [decode(2, 190, 0)] * 2) == [2, 3]   # 190 / (103 x 0.8)
    assert planner.history[-1]["inputs"]["running_ceiling"] == 103.0
    # 400 on 2 instances: a step of 200 takes 8 ms, past the TPOT: at once, to 400 / 82.4.
    assert replay(planner, "decode", [decode(2, 400, 0)], first_at=20.0) == [5]


def test_scales_down_only_after_the_window_and_one_step_at_a_time():
    planner = Planner(EXACT)
    counts = replay(planner, "prefill", [prefill(6, (10.0, 0, 0, 0))] * 12)    # needs 2
    assert counts == [6, 6, 6, 6, 6, 6, 5, 4, 3, 2, 2, 2]
    assert [h["reason"].split("; ", 1)[1] for h in planner.history] == [
        f"down from {n} (lower for 60 s; one step at a time)" for n in (6, 5, 4, 3)]


def test_no_step_down_while_the_load_right_now_asks_for_the_count():
    planner = Planner(dataclasses.replace(EXACT, trend_window_s=60.0))
    low, high = prefill(4, (10.0, 0, 0, 0)), prefill(4, (20.0, 0, 0, 0))   # need 2, 4
    assert replay(planner, "prefill", [low] * 6 + [high]) == [4] * 7
    # At 60 s the smoothed need (the window's level, one burst in it) is 3, the load's own 4.
    assert planner.state()["last"]["prefill"]["reason"] == (
        "prefill demand 2.00 s/s (100% in bucket 0) + backlog 0.0 s over 30 s needs 3 (4 now) at 0.5 "
        "utilization; hold at 4: the load now asks for 4")
    assert replay(planner, "prefill", [low] * 2, start=4, first_at=70.0) == [3, 3]


def test_an_oscillating_load_never_flaps():
    # 30 periods alternating between needing 8 and 2 instances, faster than the windows.
    series = [prefill(2, (40.0, 0, 0, 0)) if k % 2 == 0 else prefill(2, (10.0, 0, 0, 0)) for k in range(30)]
    windowed = replay(Planner(EXACT), "prefill", series)
    assert changes(windowed, 2) == 0 and windowed[-1] == 2           # never held high for 10 s
    at_once = replay(Planner(dataclasses.replace(EXACT, scale_up_window_s=0.0)), "prefill", series)
    assert changes(at_once, 2) == 1 and at_once[-1] == 8             # up to the peaks, once
    smoothed = replay(Planner(dataclasses.replace(EXACT, trend_window_s=120.0)), "prefill", series)
    assert changes(smoothed, 2) == 1 and smoothed[-1] == 5           # up to the mean, once
    defaults = replay(Planner(dataclasses.replace(PlannerConfig(), roles=EXACT.roles)), "prefill", series)
    assert changes(defaults, 2) == 1


def test_a_rising_load_is_projected_a_start_up_ahead():
    assert fit_trend([(0.0, 1.0), (10.0, 2.0), (20.0, 3.0)], 20.0) == pytest.approx((3.0, 0.1))
    assert fit_trend([(5.0, 2.0)], 5.0) == (2.0, 0.0)
    config = dataclasses.replace(EXACT, trend_window_s=60.0, forecast_lead_s=70.0,
                                 roles={"prefill": RoleLimits(1, 40)})
    # Demand rising by 0.5 s/s every 10 s: 1 more instance each period, projected 7 periods on.
    series = [prefill(2, (10.0 + 5.0 * k, 0, 0, 0)) for k in range(8)]
    planner = Planner(config)
    replay(planner, "prefill", series)
    inputs = planner.history[-1]["inputs"]
    assert inputs["level"] == pytest.approx(9.0)       # 2 x (1 + 0.5 x 7)
    assert inputs["projected"] == pytest.approx(16.0)  # + 0.1 per second x 70 s
    assert inputs["wanted"] == 16.0


# ----- limits, pause, override ----------------------------------------------------------------
def test_min_and_max_are_respected():
    planner = Planner(dataclasses.replace(EXACT, roles={"prefill": RoleLimits(2, 6)}))
    assert replay(planner, "prefill", [prefill(3, (100.0, 0, 0, 0))] * 3) == [3, 6, 6]   # needs 20
    assert replay(planner, "prefill", [prefill(1)], start=1, first_at=30.0) == [2]        # below min: at once
    planner = Planner(dataclasses.replace(EXACT, roles={"prefill": RoleLimits(2, 6)}))
    assert replay(planner, "prefill", [prefill(3)] * 10) == [3, 3, 3, 3, 3, 3, 2, 2, 2, 2]
    planner.set_limits("prefill", max_replicas=1, min_replicas=1)
    assert replay(planner, "prefill", [prefill(2)], start=2, first_at=100.0) == [1]       # above max: at once
    with pytest.raises(ValueError, match="min_replicas: must be <= max_replicas"):
        planner.set_limits("prefill", min_replicas=3)


def test_pause_holds_every_role_and_resume_acts_on_the_whole_window():
    planner = Planner(EXACT)
    planner.pause()
    assert planner.is_paused
    assert replay(planner, "prefill", [prefill(2, (40.0, 0, 0, 0))] * 3) == [2, 2, 2]
    decision = planner.observe(Signals(30.0, {"prefill": prefill(2, (40.0, 0, 0, 0)), "decode": decode(1, 0, 0)}))
    assert {d.reason for d in decision.values()} == {"paused"}
    planner.resume()
    decision = planner.observe(Signals(40.0, {"prefill": prefill(2, (40.0, 0, 0, 0))}))["prefill"]
    assert decision.desired == 8          # the need held through the pause: no new window


def test_an_override_wins_until_cleared():
    planner = Planner(EXACT)
    planner.override("prefill", 5)
    assert replay(planner, "prefill", [prefill(2, (10.0, 0, 0, 0))] * 2) == [5, 5]
    assert planner.history[-1]["reason"] == "override: 5 replicas"
    assert planner.state()["overrides"] == {"prefill": 5}
    planner.override("prefill", None)
    # Needs 2; no step down within the window of the override's growth (at 0 s).
    assert replay(planner, "prefill", [prefill(5, (10.0, 0, 0, 0))] * 8, start=5, first_at=20.0) == \
        [5, 5, 5, 5, 4, 3, 2, 2]
    with pytest.raises(ValueError, match="override replicas"):
        planner.override("prefill", -1)


def test_missing_inputs_hold_the_role():
    planner = Planner(EXACT)
    decisions = planner.observe(Signals(0.0, {"prefill": RoleSignals(3, 3)}))
    assert decisions["prefill"].desired == 3 and decisions["prefill"].reason == "hold: an input is missing"
    assert decisions["decode"].reason == "hold: no signals" and decisions["decode"].desired == 0
    with pytest.raises(ValueError, match="time order"):
        planner.observe(Signals(-1.0, {}))


def test_the_state_is_json_with_the_history_of_changes():
    planner = Planner(EXACT)
    replay(planner, "prefill", [prefill(2, (40.0, 0, 0, 0))] * 2)
    state = json.loads(json.dumps(planner.state()))
    assert state["paused"] is False and state["overrides"] == {}
    assert state["config"]["roles"]["prefill"] == {"min_replicas": 1, "max_replicas": 10}
    assert state["last"]["prefill"]["desired"] == 8
    assert [(h["at"], h["role"], h["current"], h["desired"]) for h in state["history"]] == [(10.0, "prefill", 2, 8)]


# ----- the config --------------------------------------------------------------------------------
def test_the_config_round_trips_through_json():
    config = PlannerConfig.from_json(json.dumps({"ttft_s": 1.5, "roles": {"decode": {"min_replicas": 2,
                                                                                    "max_replicas": 4}},
                                                 "decode_cost": {"a": 0.003, "b": 3e-5, "c": 0.0}}))
    assert config.ttft_s == 1.5 and config.roles == {"decode": RoleLimits(2, 4)} and config.scaled_roles == ("decode",)
    assert PlannerConfig.from_json(json.dumps(config.to_dict())) == config
    assert PlannerConfig(roles={"encoder": RoleLimits(0, 0), "kvstore": RoleLimits(1, 3)}).scaled_roles == ("kvstore",)


@pytest.mark.parametrize("settings, message", [
    ({"scale_down_window_s": -1}, "planner config scale_down_window_s: must be a number >= 0, got -1"),
    ({"ttft_s": 0}, "planner config ttft_s: must be a number > 0, got 0"),
    ({"decode_kv_target": 1.5}, r"planner config decode_kv_target: must be in \(0, 1\], got 1.5"),
    ({"interval_s": "10"}, "planner config interval_s: must be a finite number, got '10'"),
    ({"history_size": 0}, "planner config history_size: must be an integer >= 1, got 0"),
    ({"windows": 3}, "planner config windows: unknown field"),
    ({"roles": {"gpu": {"min_replicas": 1, "max_replicas": 2}}}, "planner config roles: unknown role 'gpu'"),
    ({"roles": {"prefill": {"min_replicas": 3, "max_replicas": 2}}},
     "planner config roles.prefill.min_replicas: must be <= max_replicas"),
    ({"roles": {"prefill": {"min_replicas": -1, "max_replicas": 2}}},
     "planner config roles.prefill.min_replicas: must be an integer >= 0"),
    ({"roles": {"prefill": [1, 2]}}, "planner config roles.prefill: must be an object"),
    ({"decode_cost": {"a": -1, "b": 0, "c": 0}}, "planner config decode_cost.a: must be a number >= 0"),
])
def test_config_errors_name_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        PlannerConfig.from_dict(settings)


def test_config_from_json_refuses_what_is_not_an_object():
    with pytest.raises(ValueError, match="not valid JSON"):
        PlannerConfig.from_json("{")
    with pytest.raises(ValueError, match="must be a JSON object"):
        PlannerConfig.from_json("[1]")


# ----- the signals, read off the placement core -------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_signals_from_the_placers():
    cost, clock = PrefillCost(), Clock()
    policy = PrefillBuckets(bounds=(100, 1_000, 10_000), round_s=10.0, cost=cost, clock=clock)
    estimates = [LoadEstimate(f"p{i}") for i in range(4)]
    prefill_pool: Placer = Placer("prefill", estimates, policy, clock, health_timeout_s=60.0, cost=cost)
    # p0 computes at the reference speed, p1 at half of it, p2 has not reported, p3 is leaving.
    prefill_pool.on_report(estimates[0], LoadReport("p0", "prefill", num_queued_prefill_tokens=2_000,
                                                    queued_prefill_compute_s=cost.seconds(2_000)))
    prefill_pool.on_report(estimates[1], LoadReport("p1", "prefill", num_queued_prefill_tokens=6_000,
                                                    queued_prefill_compute_s=2 * cost.seconds(6_000)))
    estimates[2].needs_report = True
    prefill_pool.retire(estimates[3])
    policy.on_arrival(RequestView("a", 50))              # bucket 0
    policy.on_arrival(RequestView("b", 5_000))           # bucket 2
    decode_estimates = [LoadEstimate("d0"), LoadEstimate("d1")]
    decode_pool: Placer = Placer("decode", decode_estimates, DecodeBalance(), clock, health_timeout_s=60.0,
                                 cost=cost)
    decode_pool.on_report(decode_estimates[0], LoadReport("d0", "decode", num_running=3, num_waiting=1,
                                                          num_kv_tokens_in_use=4_000, num_total_blocks=1_000))
    decode_pool.on_report(decode_estimates[1], LoadReport("d1", "decode", num_running=2,
                                                          num_kv_tokens_in_use=2_000, num_total_blocks=3_000))
    clock.now = 10.0                                     # the round is over: the signals close it
    signals = signals_from({"prefill": prefill_pool, "decode": decode_pool}, clock.now)
    p = signals.roles["prefill"]
    assert (p.num_replicas, p.num_ready) == (3, 2)
    assert p.demand_s == (cost.seconds(50), 0.0, cost.seconds(5_000), 0.0)
    assert p.backlog_s == (cost.seconds(50), 0.0, cost.seconds(5_000), 0.0)   # neither was placed
    assert p.period_s == 10.0
    # Both reports drained fully in the 10 s since; speed: reference over own seconds, summed.
    assert p.queued_s == 0.0
    assert p.speed == pytest.approx((cost.seconds(2_000) + cost.seconds(6_000))
                                    / (cost.seconds(2_000) + 2 * cost.seconds(6_000)))
    d = signals.roles["decode"]
    assert (d.num_replicas, d.num_ready, d.num_running, d.kv_tokens) == (2, 2, 6, 6_000)
    assert d.kv_capacity_tokens == (16_000 + 48_000) // 2
    assert signals.at == 10.0 and set(signals.roles) == {"prefill", "decode"}


def test_signals_speed_falls_back_to_the_known_ratios_when_little_is_queued():
    cost, clock = PrefillCost(), Clock()
    estimates = [LoadEstimate("p0"), LoadEstimate("p1"), LoadEstimate("p2")]
    pool: Placer = Placer("prefill", estimates, DecodeBalance(), clock, cost=cost)
    for estimate, scale in zip(estimates, (1.0, 2.0, 4.0)):
        pool.on_report(estimate, LoadReport(estimate.address, "prefill", num_queued_prefill_tokens=1_000,
                                            queued_prefill_compute_s=scale * cost.seconds(1_000)))
        pool.on_report(estimate, LoadReport(estimate.address, "prefill"))   # then idle
    p = signals_from({"prefill": pool}, 0.0, kvstore=RoleSignals(2, 2, used=5.0, capacity=10.0)).roles
    assert p["prefill"].speed == 0.5 and p["prefill"].demand_s is None      # the median; no buckets
    assert p["kvstore"].used == 5.0
    assert math.isclose(p["prefill"].queued_s, 0.0)


def test_the_core_is_pure():
    """No clock, no I/O, no asyncio, no gRPC in the core (its adapters live beside it)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "services" / "router" / "planner"
    imported = set()
    for path in (root / name for name in ("config.py", "rules.py", "core.py", "signals.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
    assert imported & {"time", "asyncio", "grpc", "socket", "threading", "random", "os"} == set()
