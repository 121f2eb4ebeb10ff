"""One trace, one cluster, one load: scaled once, then run under as many policies as asked, so
every policy sees the same arrivals and is held against the same balanced bound (``bound.py``).

Time-scaling squeezes the trace's hours into seconds, and with them every shift in its length
mix; the router's own clocks are scaled alike. Unless set, the prefill buckets' round period is
the live default (10 s) times the time factor, so a round covers the same stretch of the trace
as ten seconds of it unscaled (the synthetic trace at load 1.0 on 64 + 64: 65 ms, ~26
requests), and the instances' load reports come every live 0.5 s times the time factor (3.3 ms
there), so the router's view is as many arrivals old as it is live. Unscaled, one round would
span the whole run and the buckets would never divide the fleet, and a report would be hundreds
of arrivals stale.

An autoscaled run (``planner``: a planner config) scales the planner's clocks and the instances'
start-up by the same factor; on the trace's own clock (``load=None``) nothing is scaled, which is
what a trace built in real seconds wants.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from services.router.planner.config import PlannerConfig
from services.router.planner.core import Planner
from services.router.policies.estimate import REPORT_INTERVAL_S
from services.router.policies.prefill_buckets import DEFAULT_ROUND_S
from services.router.sim.bound import Bound, balanced_bound
from services.router.sim.cluster import SPEC, SimConfig, simulate
from services.router.sim.report import Report, Slo, build_report
from services.router.sim.scaling import Observer, Scaler, check_sim_limits, scaled_config
from services.router.sim.trace import TraceRequest, time_scaled
from services.router.sim.work import OfferedWork, offered_load, offered_work, time_factor


@dataclass(frozen=True)
class Experiment:
    requests: tuple[TraceRequest, ...]
    """The trace, time-scaled to the load."""
    config: SimConfig
    load: float
    time_factor: float
    work: OfferedWork
    """At the arrival-order replay's hits: what sets the load."""
    bound: Bound
    """The balanced bound of the scaled trace: every policy's ratio is over it."""

    @property
    def round_s(self) -> float:
        """The prefill buckets' round period on the scaled trace's clock (when not set)."""
        return DEFAULT_ROUND_S * self.time_factor

    @property
    def report_interval_s(self) -> float:
        """The instances' load report interval on the scaled trace's clock (when not set)."""
        return REPORT_INTERVAL_S * self.time_factor

    @property
    def is_prefill_busier(self) -> bool:
        prefill, decode = self.work.per_instance_s(self.config.num_prefill, self.config.num_decode)
        return prefill >= decode


def prepare(requests: Sequence[TraceRequest], config: SimConfig, load: float | None = 1.0,
            with_bound: bool = True) -> Experiment:
    """Scale ``requests`` to ``load`` (see ``work.py``). The offered work is measured on the
    trace's own clock; scaling keeps the arrival order, and the 7-day TTL outlives any trace,
    so the replay's hits, hence the offered work, are the same on the scaled one. ``load``
    None: the trace's own clock (the load is what it offers the config's fleet). Without
    ``with_bound`` the bound is left at 0 (a long trace's takes a while; ratios then read 0)."""
    if not requests:
        raise ValueError("the trace has no requests")
    work = offered_work(requests, config.costs, config.kv_capacity_blocks)
    if load is None:
        load = offered_load(requests, work, config.num_prefill, config.num_decode)
        factor = 1.0
    else:
        factor = time_factor(requests, work, config.num_prefill, config.num_decode, load)
    scaled = tuple(time_scaled(requests, factor))
    bound = balanced_bound(scaled, config.costs, config.num_prefill, config.num_decode) if with_bound \
        else Bound(0.0, 0.0, 0.0)
    return Experiment(scaled, config, load, factor, work, bound)


def evaluate(experiment: Experiment, policy: str = SPEC, seed: int = 0, slo: Slo = Slo(),
             configure: dict[str, Any] | None = None, report_interval_s: float | None = None,
             planner: PlannerConfig | None = None,
             observer: Callable[[PlannerConfig], Observer] = Planner) -> Report:
    """Run ``policy`` and hold it against the experiment's balanced bound (that of the fleet
    the config gives). ``configure``: the prefill buckets' settings (``round_s`` defaults to the
    scaled round); ``report_interval_s`` defaults to the scaled live interval. ``planner``:
    autoscale from the config's fleet with ``observer(planner config)`` (the planner, or a
    baseline), its clocks and the start-up scaled like the trace."""
    interval = experiment.report_interval_s if report_interval_s is None else report_interval_s
    # The SWA tier's TTL is a span of the trace's clock: it shrinks with the arrival gaps.
    config = replace(experiment.config, report_interval_s=interval,
                     swa_ttl_s=experiment.config.swa_ttl_s * experiment.time_factor)
    configure = {"round_s": experiment.round_s, **(configure or {})}
    scaler, label = None, policy
    if planner is not None:
        scaled = scaled_config(planner, experiment.time_factor)
        check_sim_limits(scaled)
        scaler = Scaler(observer(scaled), scaled.interval_s)
        config = replace(config, startup_s=config.startup_s * experiment.time_factor)
        label = f"{policy} autoscaled"
    result = simulate(experiment.requests, config, policy, seed, configure, scaler)
    return build_report(label, result, experiment.requests[0].arrival_s, experiment.bound.makespan_s,
                        experiment.load, experiment.time_factor, experiment.work.hit_rate,
                        experiment.is_prefill_busier, slo)
