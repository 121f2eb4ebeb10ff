"""One trace, one cluster, one load: scaled once, then run under as many policies as asked, so
every policy sees the same arrivals and is held against the same balanced bound.

Time-scaling squeezes the trace's hours into seconds, and with them every shift in its length
mix; the prefill buckets' rounds are scaled alike. Unless set, the round period is the live
default (10 s) times the time factor, so a round covers the same stretch of the trace as ten
seconds of it unscaled (the synthetic trace at load 1.0 on 64 + 64: 65 ms, ~26 requests).
Unscaled, one round would span the whole run and the buckets would never divide the fleet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.router.policies.prefill_buckets import DEFAULT_ROUND_S
from services.router.sim.cluster import SPEC, SimConfig, simulate
from services.router.sim.report import Report, Slo, build_report
from services.router.sim.trace import TraceRequest, time_scaled
from services.router.sim.work import OfferedWork, bound_makespan_s, offered_work, time_factor


@dataclass(frozen=True)
class Experiment:
    requests: tuple[TraceRequest, ...]
    """The trace, time-scaled to the load."""
    config: SimConfig
    load: float
    time_factor: float
    work: OfferedWork
    """At the arrival-order replay's hits: what sets the load."""

    @property
    def round_s(self) -> float:
        """The prefill buckets' round period on the scaled trace's clock (when not set)."""
        return DEFAULT_ROUND_S * self.time_factor

    @property
    def is_prefill_busier(self) -> bool:
        prefill, decode = self.work.per_instance_s(self.config.num_prefill, self.config.num_decode)
        return prefill >= decode


def prepare(requests: Sequence[TraceRequest], config: SimConfig, load: float = 1.0) -> Experiment:
    """Scale ``requests`` to ``load`` (see ``work.py``). The offered work is measured on the
    trace's own clock; scaling keeps the arrival order, and the 7-day TTL outlives any trace,
    so the replay's hits, hence the offered work, are the same on the scaled one."""
    if not requests:
        raise ValueError("the trace has no requests")
    work = offered_work(requests, config.costs, config.kv_capacity_blocks)
    factor = time_factor(requests, work, config.num_prefill, config.num_decode, load)
    return Experiment(tuple(time_scaled(requests, factor)), config, load, factor, work)


def evaluate(experiment: Experiment, policy: str = SPEC, seed: int = 0, slo: Slo = Slo(),
             configure: dict[str, Any] | None = None) -> Report:
    """Run ``policy`` and hold it against the balanced bound of the work that run did.
    ``configure``: the prefill buckets' settings (``round_s`` defaults to the scaled round)."""
    config = experiment.config
    configure = {"round_s": experiment.round_s, **(configure or {})}
    result = simulate(experiment.requests, config, policy, seed, configure)
    records = result.records
    bound = bound_makespan_s([r.request for r in records], [r.prefill_s for r in records], config.costs,
                             config.num_prefill, config.num_decode)
    return build_report(policy, result, experiment.requests[0].arrival_s, bound, experiment.load,
                        experiment.time_factor, experiment.work.hit_rate, experiment.is_prefill_busier, slo)
