"""Simulate a whole E/P/D cluster on a trace, under the live router's own routing policies.

    python -m services.router.sim --trace TRACE.jsonl --prefill 64 --decode 64 [--policy spec]
        [--load 1.0] [--compare [NAMES]] [--plot util.png] [--json]
    python -m services.router.sim --autoscale [--planner-config FILE] [--startup-s 60] ...

A discrete-event simulation: prefill and decode instances with the reference cost models
(``services/common/cost_model.py``), prefix hits from the trace's hash ids through the KV store's
own index (``kvstore/index.py``; with ``--sliding-window``, a hybrid model, also its SWA tier for
``--swa-ttl-s`` and the hit rule of ``kvstore/hit_rule.py``), and routing by the very policy
classes the router runs (``services/router/policies``, imported, never copied). ``--policy spec``
(the default) is the SPEC balancers, prefill_buckets for prefill and decode_balance for decode; a
baseline name (round_robin, least_requests, power_of_two, cache_aware) routes both stages.

``--load X`` time-scales the trace so the work it offers is X times what the perfectly balanced
cluster can do in the trace's span (1.0: saturated; ``services/router/sim/work.py``), and the
balanced bound, a makespan no run of that scaled trace can beat (the least work spread evenly
with zero waiting, or the latest request alone; ``services/router/sim/bound.py``), is taken on
it once, for every policy. The balance ratio is the achieved throughput over the bound's. The
router is the live one's placement core, seeing the instances through load reports every
``--report-interval-s`` (the live 0.5 s times the time factor).

Prints TTFT and TPOT p50/p99, throughput, SLO goodput, per-instance utilization, imbalance
(slowest / mean) and the ratio; ``--compare`` runs more policies on the same scaled trace and
prints a table; ``--plot`` draws per-instance utilization per policy; ``--json`` ends the output
with one JSON object for ``--policy`` (with a ``compare`` key holding the other policies').

``--autoscale`` runs the planner's own core (``services/router/planner``) against the simulated
cluster: from the fleet of ``--prefill`` / ``--decode`` (default: the planner's minimum), every
planner interval it reads the signals off the placers, decides, and starts instances (serving
after ``--startup-s``) or retires them (they drain, then leave). Without ``--load`` the trace
runs on its own clock; with it, the planner's clocks and the start-up are scaled like the
report interval. Besides the figures above it prints instance-seconds per role (GPU-seconds:
one simulated instance is one reference card) and, in ``--json``, the replicas over time. The
planner's TTFT / TPOT targets are the ``--slo-*`` ones unless ``--planner-config`` sets them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.hit_rule import ModelKVShape
from services.router.planner.config import PlannerConfig
from services.router.sim.cluster import SPEC, SimConfig, policy_names
from services.router.sim.experiment import evaluate, prepare
from services.router.sim.plot import plot_utilization
from services.router.sim.report import Slo, describe, table
from services.router.sim.scaling import check_sim_limits
from services.router.sim.trace import load_trace
from services.router.sim.work import Costs

DEFAULT_TRACE = Path(__file__).resolve().parents[4] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
COMPARE_DEFAULT = (SPEC, "round_robin", "least_requests", "power_of_two", "cache_aware")


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.router.sim", description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    p.add_argument("--limit", type=int, default=0, help="only the trace's first N requests (0: all)")
    p.add_argument("--prefill", type=int, default=None,
                   help="prefill instances (default 64; autoscaled: the planner's minimum to start from)")
    p.add_argument("--decode", type=int, default=None, help="decode instances (as --prefill)")
    p.add_argument("--policy", default=SPEC, help=f"{SPEC} (the SPEC balancers) or one policy for both stages")
    p.add_argument("--load", type=float, default=None,
                   help="offered work / balanced capacity (default 1.0: saturated; autoscaled: the trace's clock)")
    p.add_argument("--compare", nargs="?", const=",".join(COMPARE_DEFAULT), default="",
                   help=f"comma-separated policies to run too (alone: {','.join(COMPARE_DEFAULT)})")
    p.add_argument("--plot", type=Path, default=None, help="PNG of per-instance utilization per policy")
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.add_argument("--seed", type=int, default=0, help="seed of the randomized policies")
    p.add_argument("--slo-ttft-s", type=float, default=Slo.ttft_s, help="TTFT SLO for goodput")
    p.add_argument("--slo-tpot-s", type=float, default=Slo.tpot_s, help="TPOT SLO for goodput")
    p.add_argument("--step-budget-s", type=float, default=Costs.step_budget_s, help="prefill step time budget")
    p.add_argument("--chunk-tokens", type=int, default=0, help="fixed prefill chunk instead of the budget")
    p.add_argument("--decode-max-batch", type=int, default=Costs.decode_max_batch, help="decode batch cap")
    p.add_argument("--kv-capacity-blocks", type=int, default=SimConfig.kv_capacity_blocks,
                   help="blocks the shared KV store index holds")
    p.add_argument("--hits-at", choices=("start", "arrival"), default="start",
                   help="when a prefill's KV store hit is looked up (see SimConfig.hits_at)")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="a hybrid model's sliding window in tokens: hits also need its SWA window (default: none)")
    p.add_argument("--replay-tokens", type=int, default=0,
                   help="tokens a hit without its SWA window recomputes (the reference: 20 * 127 = 2540)")
    p.add_argument("--swa-ttl-s", type=float, default=SimConfig.swa_ttl_s,
                   help="seconds the KV store's SWA tier keeps a window (a hybrid model)")
    p.add_argument("--round-s", type=float, default=None,
                   help="prefill buckets' round period (default: the live 10 s x the trace's time factor)")
    p.add_argument("--report-interval-s", type=float, default=None,
                   help="instances' load report period (default: the live 0.5 s x the trace's time factor)")
    p.add_argument("--room-s", type=float, default=None,
                   help="prefill buckets: queued compute under which an instance takes a waiting request")
    p.add_argument("--bucket-bounds", type=int_list, default=None, help="3 prompt-length bounds, e.g. 16384,65536,262144")
    p.add_argument("--bucket-caps", type=int_list, default=None, help="4 per-bucket instance caps (0: none)")
    p.add_argument("--decode-kv-capacity-tokens", type=int, default=SimConfig.decode_kv_capacity_tokens,
                   help="KV tokens a decode instance holds (0: no limit)")
    p.add_argument("--autoscale", action="store_true", help="scale the fleet with the planner")
    p.add_argument("--planner-config", type=Path, default=None, help="planner config JSON (PlannerConfig)")
    p.add_argument("--startup-s", type=float, default=SimConfig.startup_s,
                   help="seconds an instance started by the planner loads before it serves")
    return p


def kv_shape(args: argparse.Namespace) -> ModelKVShape:
    if args.sliding_window is not None and args.sliding_window < 1:
        raise ValueError(f"--sliding-window must be >= 1 (got {args.sliding_window})")
    if args.replay_tokens < 0 or (args.replay_tokens and args.sliding_window is None):
        raise ValueError(f"--replay-tokens must be >= 0, and needs --sliding-window (got {args.replay_tokens})")
    return ModelKVShape(args.sliding_window, args.replay_tokens)


def planner_config(args: argparse.Namespace) -> PlannerConfig | None:
    """The planner's config with --autoscale (the --slo-* targets unless the file sets them)."""
    if not args.autoscale:
        return None
    settings = json.loads(args.planner_config.read_text()) if args.planner_config else {}
    if not isinstance(settings, dict):
        raise ValueError(f"{args.planner_config}: a planner config must be a JSON object")
    config = PlannerConfig.from_dict({"ttft_s": args.slo_ttft_s, "tpot_s": args.slo_tpot_s, **settings})
    check_sim_limits(config)
    return config


def fleet(args: argparse.Namespace, planner: PlannerConfig | None) -> tuple[int, int]:
    """The fleet to run (autoscaled: to start from)."""
    def start(role: str, given: int | None) -> int:
        if given is not None:
            return given
        if planner is None:
            return 64
        limits = planner.roles.get(role)
        return max(1, limits.min_replicas) if limits is not None else 1
    return start("prefill", args.prefill), start("decode", args.decode)


def bucket_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """What the live router passes to the prefill buckets' ``configure`` (only what was given)."""
    settings = {"bounds": args.bucket_bounds, "caps": args.bucket_caps, "round_s": args.round_s,
                "room_s": args.room_s}
    settings = {key: value for key, value in settings.items() if value is not None}
    return settings or None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    policies = [args.policy] + [name for name in args.compare.split(",") if name and name != args.policy]
    try:
        for name in policies:
            policy_names(name)
        costs = Costs(step_budget_s=args.step_budget_s, chunk_tokens=args.chunk_tokens,
                      decode_max_batch=args.decode_max_batch)
        planner = planner_config(args)
        num_prefill, num_decode = fleet(args, planner)
        config = SimConfig(num_prefill, num_decode, costs, args.kv_capacity_blocks, hits_at=args.hits_at,
                           report_interval_s=SimConfig.report_interval_s if args.report_interval_s is None
                           else args.report_interval_s, decode_kv_capacity_tokens=args.decode_kv_capacity_tokens,
                           startup_s=args.startup_s, kv_shape=kv_shape(args), swa_ttl_s=args.swa_ttl_s)
        requests = load_trace(args.trace, args.limit)
        started = time.perf_counter()
        experiment = prepare(requests, config, 1.0 if args.load is None and not args.autoscale else args.load)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    slo = Slo(args.slo_ttft_s, args.slo_tpot_s)
    reports = []
    for name in policies:
        reports.append(evaluate(experiment, name, args.seed, slo, bucket_settings(args), args.report_interval_s,
                                planner))
        print(describe(reports[-1]), end="\n\n", flush=True)
    if len(reports) > 1:
        print(table(reports), end="\n\n")
    if args.plot is not None:
        print(f"utilization plot: {plot_utilization(reports, args.plot)}")
    round_s = experiment.round_s if args.round_s is None else args.round_s
    interval_s = experiment.report_interval_s if args.report_interval_s is None else args.report_interval_s
    print(f"{len(requests)} requests, {num_prefill} prefill + {num_decode} decode"
          f"{' to start, autoscaled' if planner is not None else ''}, prefill bucket "
          f"rounds of {round_s:.3g} s, load reports every {interval_s:.3g} s, {len(reports)} run(s) in "
          f"{time.perf_counter() - started:.1f} s")
    if args.json:
        figures = {**reports[0].as_json(), "round_s": round(round_s, 6), "report_interval_s": round(interval_s, 9)}
        if len(reports) > 1:
            figures["compare"] = {r.policy: r.summary() for r in reports[1:]}
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
