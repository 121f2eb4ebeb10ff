"""The router's view of its instance pools, as Prometheus metrics read at scrape time.

Nothing here is updated on the request path: :class:`PoolMetrics` reads each pool's latest
load reports, health, drain flags and pick counts when /metrics is scraped, the way the KV
store's NodeMetrics reads its node. Every per-instance series is labelled ``role`` and
``instance_id``; not ``instance``, which Prometheus itself sets on every scraped series to the
target's address (a scraped ``instance`` label would be renamed ``exported_instance``).

    epd_router_instance_healthy / _draining          every instance (1 or 0)
    epd_router_instance_running_requests, ...         instances that sent a load report
    epd_router_bucket_instances / _demand_seconds     the prefill policy, when it has buckets
    epd_router_picks_total                            picks per role and policy name
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.common.wire import LoadReport
from services.router.cluster.instances import InstancePool

INSTANCE_LABELS = ["role", "instance_id"]
LOAD_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("epd_router_instance_running_requests", "num_running", "Requests running on the instance (its last load report)."),
    ("epd_router_instance_waiting_requests", "num_waiting", "Requests waiting on the instance (its last load report)."),
    ("epd_router_instance_queued_prefill_tokens", "num_queued_prefill_tokens",
     "Prompt tokens queued for prefill on the instance (its last load report)."),
    ("epd_router_instance_kv_tokens", "num_kv_tokens_in_use",
     "KV tokens held by the instance's running requests (its last load report)."),
    ("epd_router_instance_free_blocks", "num_free_blocks", "Free KV blocks on the instance (its last load report)."),
    ("epd_router_instance_restarts", "num_restarts", "Times the instance's supervisor restarted it (its last load report)."),
)
"""(metric name, LoadReport field, help)."""


class PoolMetrics:
    """Prometheus collector over ``pools`` (role -> pool); swap ``pools`` to watch others."""

    def __init__(self, pools: Mapping[str, InstancePool]) -> None:
        self.pools = pools

    def describe(self) -> Iterator[Metric]:
        # Names only, so registering does not read pools that may not be connected yet.
        yield from self._families().values()

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        for pool in self.pools.values():
            self._add_instances(families, pool)
            # A copy: /metrics is served from a worker thread while the event loop keeps picking.
            for policy_name, num_picks in dict(pool.picks).items():
                families["picks"].add_metric([pool.role, policy_name], num_picks)
            for queue, num_waiting in pool.waiting.sizes().items():
                families["queue_waiting"].add_metric([pool.role, str(queue)], num_waiting)
        prefill = self.pools.get("prefill")
        if prefill is not None:
            self._add_buckets(families, prefill)
        yield from (family for family in families.values() if family.samples)

    @staticmethod
    def _families() -> dict[str, Metric]:
        families: dict[str, Metric] = {
            "healthy": GaugeMetricFamily("epd_router_instance_healthy", "0 once its load reports stopped, or an "
                                         "RPC to it found it unavailable, until it reports again.",
                                         labels=INSTANCE_LABELS),
            "draining": GaugeMetricFamily("epd_router_instance_draining", "1 while the instance takes no new "
                                          "requests (drained by the admin API or by itself).", labels=INSTANCE_LABELS),
        }
        for name, field, documentation in LOAD_GAUGES:
            families[field] = GaugeMetricFamily(name, documentation, labels=INSTANCE_LABELS)
        families["bucket_instances"] = GaugeMetricFamily(
            "epd_router_bucket_instances", "Prefill instances assigned to each prompt-length bucket "
            "(all 0 while the fleet is one pool).", labels=["bucket"])
        families["bucket_demand"] = GaugeMetricFamily(
            "epd_router_bucket_demand_seconds", "Prefill compute (cost-model seconds) each bucket demanded in "
            "the last finished round.", labels=["bucket"])
        families["bucket_backlog"] = GaugeMetricFamily(
            "epd_router_bucket_backlog_seconds", "Prefill compute (cost-model seconds) still waiting in each "
            "bucket's router queue when the last round closed.", labels=["bucket"])
        families["queue_waiting"] = GaugeMetricFamily(
            "epd_router_queue_waiting", "Requests waiting in the router's queue for an instance (a queueing "
            "policy; the prefill buckets keep one queue per bucket).", labels=["role", "queue"])
        families["picks"] = CounterMetricFamily("epd_router_picks", "Instances picked, per role and policy.",
                                                labels=["role", "policy"])
        return families

    @staticmethod
    def _add_instances(families: dict[str, Metric], pool: InstancePool) -> None:
        for instance, view in zip(pool.instances, pool.views()):
            labels = [pool.role, view.instance_id]
            families["healthy"].add_metric(labels, float(view.is_healthy))
            families["draining"].add_metric(labels, float(view.is_draining))
            load: LoadReport | None = instance.load
            if load is None:  # never heard from: no figures to show
                continue
            for _, field, _ in LOAD_GAUGES:
                families[field].add_metric(labels, getattr(load, field))

    @staticmethod
    def _add_buckets(families: dict[str, Metric], pool: InstancePool) -> None:
        policy = pool.policy
        allocation = getattr(policy, "allocation", None)
        demand_s = getattr(policy, "last_demand_s", None)
        backlog_s = getattr(policy, "last_backlog_s", None)
        if allocation is not None:
            for bucket, instance_ids in allocation.items():
                families["bucket_instances"].add_metric([str(bucket)], len(instance_ids))
        if demand_s is not None:
            for bucket, seconds in enumerate(demand_s):
                families["bucket_demand"].add_metric([str(bucket)], seconds)
        if backlog_s is not None:
            for bucket, seconds in enumerate(backlog_s):
                families["bucket_backlog"].add_metric([str(bucket)], seconds)


_collector: PoolMetrics | None = None


def register_pool_metrics(pools: Mapping[str, InstancePool]) -> PoolMetrics:
    """Serve ``pools`` on the default registry's /metrics. Registers one collector per process;
    a later call (another app in the same process: tests) points it at the new pools."""
    global _collector
    if _collector is None:
        _collector = PoolMetrics(pools)
        REGISTRY.register(_collector)
    else:
        _collector.pools = pools
    return _collector
