"""Autoscaling on the simulator: the planner against the best fixed fleet that meets the same SLO.

    python benchmarks/autoscale.py [--quick] [--startup-s 60] [--planner-config FILE]

**Trace.** The Mooncake trace's requests (``../shared/traces/mooncake_synthetic_trace.jsonl``:
their real lengths and prefix blocks, in order) arriving in phases of changing rate
(``services/router/sim/trace.py``, ``phased``; Poisson, 60 s ramps between phases), on the real
clock (no time-scaling: the reference cost models, a 60 s instance start-up):

    low 10 req/s (10 min) -> long-prompt surge: 10 req/s + 3 req/s of prompts >= 32K (10 min)
    -> high 36 req/s (7.5 min) -> low 6 req/s (15 min)

``--quick`` keeps the shape at a fifth of the durations (a smoke test: too short for the
windows and the start-up to pay off, so its figures say little).

**SLO attainment**: the fraction of all requests that meet both the TTFT and the TPOT SLO
(``sim/report.py``: ``Report.slo_attainment`` under ``Slo``; defaults TTFT 2 s, TPOT 50 ms; a
request with one output token has no TPOT and needs only the TTFT).

**Instance-seconds** (GPU-seconds: a simulated instance is one reference card): each instance's
time from its start (its start-up included) to its removal (after draining), within the run
from the first arrival to the last token; a fixed fleet's is its size times that span.

**The best fixed fleet** is the one with the fewest instance-seconds among those whose SLO
attainment is at least the planner's minus 0.02: decode first (the fewest decode instances
that reach it with prefill to spare), then the fewest prefill instances with that decode
(binary search; TTFT is prefill's alone and TPOT decode's alone, so the two searches are
apart). **Baseline** ``load_mode``: a Dynamo-like load mode, replicas proportional to the
current utilization every interval (``ceil(busy instances / target)``), with none of the
planner's windows, trend or backlog terms.

Goal: ``slo_gap`` (fixed minus planner attainment) <= 0.02 at ``instance_ratio`` (planner over
fixed instance-seconds) <= 0.8. Progress goes to stderr; the last line on stdout is one JSON
object: planner_slo, fixed_slo, planner_instance_s, fixed_instance_s, instance_ratio, slo_gap,
fixed_fleet, planner_max_replicas, planner (its TTFT / TPOT percentiles, replica changes),
load_mode (the baseline's figures), requests, seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.router.planner.config import PlannerConfig, RoleLimits  # noqa: E402
from services.router.planner.core import Decision, Signals  # noqa: E402
from services.router.planner.rules import running_ceiling  # noqa: E402
from services.router.sim.cluster import SimConfig  # noqa: E402
from services.router.sim.experiment import Experiment, evaluate, prepare  # noqa: E402
from services.router.sim.report import Report, Slo  # noqa: E402
from services.router.sim.trace import Phase, TraceRequest, load_trace, phased  # noqa: E402

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
PHASES = (Phase(600, 10.0), Phase(600, 10.0, 3.0), Phase(450, 36.0), Phase(900, 6.0))
"""(duration s, req/s of the trace's mix, req/s of its long prompts on top)."""
RAMP_S = 180.0
"""Each phase's rate is reached over this (linearly from the last one's)."""
SLO_SLACK = 0.02
DECODE_KV_TOKENS = 1_000_000
"""KV tokens a decode instance holds by default (a reference card's room beside the weights;
at this trace's load decode KV then never binds, and decode stays at one instance)."""
PLANNER = PlannerConfig(roles={"prefill": RoleLimits(2, 16), "decode": RoleLimits(1, 8)})
"""Never one prefill instance: a burst of cold long prompts queues past the TTFT on one alone
for the start-up of a second (and one is no redundancy)."""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_trace(quick: bool, seed: int) -> list[TraceRequest]:
    scale = 0.2 if quick else 1.0
    phases = [dataclasses.replace(p, duration_s=p.duration_s * scale) for p in PHASES]
    return phased(load_trace(TRACE), phases, long_tokens=32_768, ramp_s=RAMP_S * scale, seed=seed)


class LoadMode:
    """The baseline: every interval, each role at ceil(its busy instances' worth / target),
    from the current signals alone (no windows, no trend, no backlog)."""

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config

    def observe(self, signals: Signals) -> dict[str, Decision]:
        decisions = {}
        for role in self.config.scaled_roles:
            s = signals.roles[role]
            if role == "prefill" and s.demand_s is not None and s.period_s and s.speed:
                busy = sum(s.demand_s) / s.period_s / s.speed / self.config.prefill_utilization_target
            elif role == "decode" and s.num_running is not None:
                kv_per = (s.kv_tokens or 0) / s.num_running if s.num_running else 0.0
                ceiling = running_ceiling(self.config.decode_cost, self.config.tpot_s, kv_per,
                                          self.config.decode_max_running)
                busy = max(s.num_running / (ceiling * self.config.decode_running_target),
                           (s.kv_tokens or 0) / (s.kv_capacity_tokens * self.config.decode_kv_target)
                           if s.kv_capacity_tokens else 0.0)
            else:
                busy = float(s.num_replicas)
            desired = self.config.roles[role].clamp(math.ceil(busy - 1e-9))
            decisions[role] = Decision(role, s.num_replicas, desired, "load mode", {"busy": busy})
        return decisions


def run(experiment: Experiment, num_prefill: int, num_decode: int, slo: Slo,
        planner: PlannerConfig | None = None, observer=None) -> Report:
    config = dataclasses.replace(experiment.config, num_prefill=num_prefill, num_decode=num_decode)
    started = time.perf_counter()
    kwargs = {"observer": observer} if observer is not None else {}
    report = evaluate(dataclasses.replace(experiment, config=config), slo=slo, planner=planner, **kwargs)
    kind = "autoscaled" if planner is not None else "fixed"
    log(f"  {kind} {num_prefill}P+{num_decode}D: SLO {report.slo_attainment:.4f}, "
        f"{report.instance_s:.0f} instance-s (prefill {report.instance_s_prefill:.0f}, decode "
        f"{report.instance_s_decode:.0f}), TTFT p99 {report.ttft_p99_s:.2f} s, TPOT p99 "
        f"{report.tpot_p99_s * 1e3:.1f} ms, at most {report.max_prefill}P+{report.max_decode}D "
        f"[{time.perf_counter() - started:.1f} s]")
    return report


def best_fixed(experiment: Experiment, slo: Slo, target: float, max_prefill: int,
               max_decode: int) -> tuple[int, int, Report]:
    """The fewest decode, then prefill instances reaching ``target`` (the largest tried if none)."""
    decode = max_decode
    for d in range(1, max_decode + 1):
        if run(experiment, max_prefill, d, slo).slo_attainment >= target:
            decode = d
            break
    low, high = 1, max_prefill
    reports: dict[int, Report] = {}
    while low < high:
        middle = (low + high) // 2
        reports[middle] = run(experiment, middle, decode, slo)
        if reports[middle].slo_attainment >= target:
            high = middle
        else:
            low = middle + 1
    return low, decode, reports.get(low) or run(experiment, low, decode, slo)


def figures(report: Report) -> dict[str, object]:
    changes = sum(1 for a, b in zip(report.replicas, report.replicas[1:]) if a[1:] != b[1:])
    return {"slo": round(report.slo_attainment, 4), "instance_s": round(report.instance_s, 1),
            "ttft_p50_s": round(report.ttft_p50_s, 3), "ttft_p99_s": round(report.ttft_p99_s, 3),
            "tpot_p99_s": round(report.tpot_p99_s, 5), "max_replicas": {"prefill": report.max_prefill,
                                                                       "decode": report.max_decode},
            "replica_changes": changes}


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a fifth of the trace (smoke test)")
    parser.add_argument("--startup-s", type=float, default=SimConfig.startup_s, help="instance start-up")
    parser.add_argument("--planner-config", type=Path, default=None, help="PlannerConfig JSON")
    parser.add_argument("--start-prefill", type=int, default=3, help="prefill instances the planner starts with")
    parser.add_argument("--start-decode", type=int, default=1, help="decode instances the planner starts with")
    parser.add_argument("--decode-kv-tokens", type=int, default=DECODE_KV_TOKENS,
                        help="KV tokens a decode instance holds (smaller: decode scales on KV use too)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the load-mode baseline")
    parser.add_argument("--seed", type=int, default=0, help="arrival seed")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    slo = Slo()
    planner = PlannerConfig.from_json(args.planner_config.read_text()) if args.planner_config else PLANNER
    planner = dataclasses.replace(planner, ttft_s=slo.ttft_s, tpot_s=slo.tpot_s)
    requests = build_trace(args.quick, args.seed)
    log(f"trace: {len(requests)} requests over {requests[-1].arrival_s:.0f} s")
    config = SimConfig(args.start_prefill, args.start_decode, decode_kv_capacity_tokens=args.decode_kv_tokens,
                       startup_s=args.startup_s)
    experiment = prepare(requests, config, load=None, with_bound=False)
    log("planner:")
    autoscaled = run(experiment, args.start_prefill, args.start_decode, slo, planner)
    target = autoscaled.slo_attainment - SLO_SLACK
    log(f"fixed fleets reaching SLO {target:.4f}:")
    num_prefill, num_decode, fixed = best_fixed(experiment, slo, target, autoscaled.max_prefill + 2,
                                                autoscaled.max_decode + 1)
    result: dict[str, object] = {
        "planner_slo": round(autoscaled.slo_attainment, 4), "fixed_slo": round(fixed.slo_attainment, 4),
        "planner_instance_s": round(autoscaled.instance_s, 1), "fixed_instance_s": round(fixed.instance_s, 1),
        "instance_ratio": round(autoscaled.instance_s / fixed.instance_s, 4),
        "slo_gap": round(fixed.slo_attainment - autoscaled.slo_attainment, 4),
        "fixed_fleet": {"prefill": num_prefill, "decode": num_decode},
        "planner_max_replicas": {"prefill": autoscaled.max_prefill, "decode": autoscaled.max_decode},
        "planner": figures(autoscaled), "fixed": figures(fixed)}
    if not args.no_baseline:
        log("baseline (load mode):")
        baseline = run(experiment, args.start_prefill, args.start_decode, slo, planner, LoadMode)
        result["load_mode"] = {**figures(baseline),
                               "instance_ratio": round(baseline.instance_s / fixed.instance_s, 4),
                               "slo_gap": round(fixed.slo_attainment - baseline.slo_attainment, 4)}
    result["requests"] = len(requests)
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
