"""A run's figures: latency percentiles, throughput against the balanced bound, SLO goodput,
per-instance utilization and imbalance; as text and as one JSON object.

Definitions (times in seconds, t0 the trace's first arrival):

- makespan: t0 to the last request's last token;
- throughput_tok_s: output tokens of the trace / makespan;
- balanced_ratio: throughput_tok_s / bound_throughput_tok_s = bound makespan / makespan (the
  bound: ``services/router/sim/bound.py``, one per trace and load, the same for every policy,
  so ratios rank policies as their throughputs do; at most 1);
- TTFT: arrival to the first token (the end of prefill); TPOT: (last token - first token) /
  (output tokens - 1), over requests with at least two output tokens;
- goodput: requests (and their output tokens) meeting both SLOs, per second of makespan;
- utilization: an instance's busy seconds / makespan (decode: seconds with a batch running);
- imbalance: the slowest instance's busy seconds / the mean, per stage; the headline figure is
  the busier stage's (the one with more balanced work per instance);
- instance-seconds (GPU-seconds: a simulated instance is one reference card): the seconds each
  instance existed between t0 and the makespan's end, start-up and draining included
  (``scaling.py``); a fixed fleet's is its size times the makespan;
- replicas (autoscaled runs): instances per role counted at each planner tick.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from services.router.sim.cluster import SimResult
from services.router.sim.scaling import instance_seconds


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.05


@dataclass(frozen=True)
class Report:
    policy: str
    num_requests: int
    load: float
    time_factor: float
    makespan_s: float
    bound_makespan_s: float
    balanced_ratio: float
    throughput_tok_s: float
    bound_throughput_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    goodput_req_s: float
    goodput_tok_s: float
    slo_attainment: float
    hit_rate: float
    """Prompt tokens served by the KV store in this run / all prompt tokens."""
    swa_hit_rate: float | None
    """A hybrid model: of the prefills whose block hit needed a sliding window, the share that
    found it in the SWA tier (the rest replayed); None for a plain model."""
    offered_hit_rate: float
    """The same in the arrival-order replay that set the load (work.py)."""
    imbalance: float
    imbalance_prefill: float
    imbalance_decode: float
    prefill_utilization: tuple[float, ...]
    decode_utilization: tuple[float, ...]
    instance_s_prefill: float = 0.0
    instance_s_decode: float = 0.0
    max_prefill: int = 0
    """The most prefill instances counted at once (the fleet, when not autoscaled)."""
    max_decode: int = 0
    replicas: tuple[tuple[float, int, int], ...] = ()
    """Autoscaled: (time, prefill, decode) at each planner tick."""

    @property
    def instance_s(self) -> float:
        return self.instance_s_prefill + self.instance_s_decode

    def summary(self) -> dict[str, float | int | str]:
        """Every scalar figure (no per-instance lists), rounded for printing."""
        figures = {key: _rounded(value) for key, value in asdict(self).items()
                   if not isinstance(value, (tuple, list))}
        figures["instance_s"] = _rounded(self.instance_s)
        return figures

    def as_json(self) -> dict[str, object]:
        figures: dict[str, object] = dict(self.summary())
        figures["prefill_utilization"] = [round(u, 4) for u in self.prefill_utilization]
        figures["decode_utilization"] = [round(u, 4) for u in self.decode_utilization]
        if self.replicas:
            figures["replicas"] = [[round(t, 3), p, d] for t, p, d in self.replicas]
        return figures


def _rounded(value: object) -> object:
    return round(value, 6) if isinstance(value, float) else value


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else 0.0


def imbalance(busy_s: Sequence[float]) -> float:
    """Slowest / mean (1.0 when nothing was busy)."""
    mean = sum(busy_s) / len(busy_s) if busy_s else 0.0
    return max(busy_s) / mean if mean > 0 else 1.0


def build_report(policy: str, result: SimResult, start_s: float, bound_makespan_s: float, load: float,
                 time_factor: float, offered_hit_rate: float, prefill_bound_first: bool, slo: Slo) -> Report:
    """``prefill_bound_first``: prefill is the busier stage (its imbalance is the headline)."""
    records = result.records
    makespan = max(r.finish_s for r in records) - start_s if records else 0.0
    num_tokens = sum(r.request.output_length for r in records)
    ttfts = [r.ttft_s for r in records]
    tpots = [t for r in records if (t := r.tpot_s) is not None]
    good = [r for r in records if r.ttft_s <= slo.ttft_s and (r.tpot_s or 0.0) <= slo.tpot_s]
    per_s = 1.0 / makespan if makespan > 0 else 0.0
    prefill_busy = [p.busy_s for p in result.prefills]
    decode_busy = [d.busy_s for d in result.decodes]
    num_prompt = sum(r.request.input_length for r in records)
    imbalance_prefill, imbalance_decode = imbalance(prefill_busy), imbalance(decode_busy)
    replicas = tuple((t, counts["prefill"], counts["decode"]) for t, counts in result.replicas)
    end_s = start_s + makespan
    return Report(
        policy=policy, num_requests=len(records), load=load, time_factor=time_factor,
        makespan_s=makespan, bound_makespan_s=bound_makespan_s,
        balanced_ratio=bound_makespan_s / makespan if makespan > 0 else 1.0,
        throughput_tok_s=num_tokens * per_s,
        bound_throughput_tok_s=num_tokens / bound_makespan_s if bound_makespan_s > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
        tpot_p50_s=percentile(tpots, 50), tpot_p99_s=percentile(tpots, 99),
        goodput_req_s=len(good) * per_s, goodput_tok_s=sum(r.request.output_length for r in good) * per_s,
        slo_attainment=len(good) / len(records) if records else 0.0,
        hit_rate=sum(r.num_cached for r in records) / num_prompt if num_prompt else 0.0,
        swa_hit_rate=result.hits.swa_hit_rate,
        offered_hit_rate=offered_hit_rate,
        imbalance=imbalance_prefill if prefill_bound_first else imbalance_decode,
        imbalance_prefill=imbalance_prefill, imbalance_decode=imbalance_decode,
        prefill_utilization=tuple(b * per_s for b in prefill_busy),
        decode_utilization=tuple(b * per_s for b in decode_busy),
        instance_s_prefill=instance_seconds(result.prefills, start_s, end_s),
        instance_s_decode=instance_seconds(result.decodes, start_s, end_s),
        max_prefill=max([len(result.prefills) if not replicas else 0] + [p for _, p, _ in replicas]),
        max_decode=max([len(result.decodes) if not replicas else 0] + [d for _, _, d in replicas]),
        replicas=replicas)


TABLE_COLUMNS = (("policy", "policy", "{}"), ("balanced_ratio", "ratio", "{:.3f}"),
                 ("throughput_tok_s", "tok/s", "{:.0f}"), ("ttft_p50_s", "TTFT p50", "{:.3f}"),
                 ("ttft_p99_s", "TTFT p99", "{:.3f}"), ("tpot_p50_s", "TPOT p50", "{:.4f}"),
                 ("tpot_p99_s", "TPOT p99", "{:.4f}"), ("goodput_req_s", "good req/s", "{:.1f}"),
                 ("slo_attainment", "SLO met", "{:.3f}"), ("imbalance", "imbalance", "{:.3f}"),
                 ("makespan_s", "makespan", "{:.2f}"))


def table(reports: Sequence[Report]) -> str:
    """One row per run, aligned columns."""
    header = [title for _, title, _ in TABLE_COLUMNS]
    rows = [[fmt.format(getattr(r, key)) for key, _, fmt in TABLE_COLUMNS] for r in reports]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in [header, *rows]]
    return "\n".join(lines)


def describe(report: Report) -> str:
    """A few readable lines on one run."""
    return "\n".join([
        f"policy {report.policy}: {report.num_requests} requests at load {report.load:g} "
        f"(arrival gaps x{report.time_factor:.4g}), prefix hit rate {report.hit_rate:.3f} "
        f"(arrival-order replay: {report.offered_hit_rate:.3f})"
        + (f", SWA window hit rate {report.swa_hit_rate:.3f}" if report.swa_hit_rate is not None else ""),
        f"makespan {report.makespan_s:.3f} s vs balanced bound {report.bound_makespan_s:.3f} s: "
        f"throughput {report.throughput_tok_s:.0f} tok/s = {report.balanced_ratio:.3f} of the bound's "
        f"{report.bound_throughput_tok_s:.0f}",
        f"TTFT p50 {report.ttft_p50_s:.3f} s p99 {report.ttft_p99_s:.3f} s; "
        f"TPOT p50 {report.tpot_p50_s * 1e3:.2f} ms p99 {report.tpot_p99_s * 1e3:.2f} ms",
        f"goodput {report.goodput_req_s:.2f} req/s, {report.goodput_tok_s:.0f} tok/s "
        f"(SLO met by {report.slo_attainment:.3f})",
        f"instance-seconds (GPU-seconds, one instance = one reference card): prefill "
        f"{report.instance_s_prefill:.0f}, decode {report.instance_s_decode:.0f}, total {report.instance_s:.0f}"
        + (f"; replicas at most {report.max_prefill} prefill + {report.max_decode} decode" if report.replicas else ""),
        f"imbalance (slowest / mean busy): prefill {report.imbalance_prefill:.3f}, "
        f"decode {report.imbalance_decode:.3f}",
        f"utilization: prefill mean {np.mean(report.prefill_utilization):.3f} "
        f"[{min(report.prefill_utilization):.3f}, {max(report.prefill_utilization):.3f}], "
        f"decode mean {np.mean(report.decode_utilization):.3f} "
        f"[{min(report.decode_utilization):.3f}, {max(report.decode_utilization):.3f}]"])
