"""The Grafana dashboard names only metrics the code defines; PoolMetrics reads pools at scrape time."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
from prometheus_client import REGISTRY

from services.common.cost_model import PrefillCost
from services.common.wire import LoadReport
from services.router.cluster.instances import InstancePool
from services.router.cluster.metrics import PoolMetrics, register_pool_metrics
from services.router.policies import RequestView, make_policy
from services.router.policies.prefill_buckets import PrefillBuckets

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "dashboards" / "epd.json"
METRIC_NAME = re.compile(r"\bepd_[a-z0-9_]+")
# Added by prometheus_client to a counter's or histogram's samples; not part of the defined name.
SAMPLE_SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def defined_names() -> set[str]:
    """Every quoted ``epd_*`` name in the services' and the store's code, ``_total`` stripped
    (counters are defined with and without it)."""
    names = set()
    for path in [*(ROOT / "services").rglob("*.py"), *(ROOT / "kvstore").rglob("*.py")]:
        for name in re.findall(r"[\"'](epd_[a-z0-9_]+)[\"']", path.read_text()):
            names.add(name.removesuffix("_total"))
    return names


def base_names(sample_name: str) -> set[str]:
    return {sample_name, *(sample_name.removesuffix(s) for s in SAMPLE_SUFFIXES)}


def test_dashboard_loads_with_titles_and_units():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 39
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 12
    assert all(p["title"] and p["fieldConfig"]["defaults"]["unit"] for p in panels)
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in panels)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_dashboard_uses_only_defined_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for p in dashboard["panels"] for t in p.get("targets", ())
            for name in METRIC_NAME.findall(t["expr"])}
    defined = defined_names()
    assert {"epd_router_inter_token_latency_seconds_bucket", "epd_router_cached_prompt_tokens_total",
            "epd_router_bucket_instances", "epd_kv_transfer_bytes_total"} <= used
    assert sorted(n for n in used if not base_names(n) & defined) == []


def router_figures(endpoint: str) -> dict[str, float]:
    labels = {"endpoint": endpoint}
    names = ("epd_router_inter_token_latency_seconds_count", "epd_router_inter_token_latency_seconds_sum",
             "epd_router_cached_prompt_tokens_total", "epd_router_prompt_tokens_total",
             "epd_router_generation_tokens_total")
    return {name: REGISTRY.get_sample_value(name, labels) or 0.0 for name in names}


def test_inter_token_latency_and_cached_tokens(make_backend, serve):
    """7 tokens in chunks of 3, 3, 1 after 20 ms each: the first chunk's 3 give TTFT and no
    inter-token sample; the next 3 are 3 samples of a third of their gap; the last is 1 sample."""
    endpoint = "/v1/chat/completions"
    url = serve(make_backend(tokens_per_chunk=3, delay_s=0.02, num_cached_tokens=32))
    before = router_figures(endpoint)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7}
    usage = httpx.post(f"{url}{endpoint}", json=body, timeout=10).json()["usage"]
    after = router_figures(endpoint)
    delta = {name: after[name] - before[name] for name in after}
    assert usage["completion_tokens"] == 7 and usage["prompt_tokens_details"] == {"cached_tokens": 32}
    assert delta["epd_router_generation_tokens_total"] == 7
    assert delta["epd_router_inter_token_latency_seconds_count"] == 4
    assert 0.035 <= delta["epd_router_inter_token_latency_seconds_sum"] < 1.0
    assert delta["epd_router_cached_prompt_tokens_total"] == 32
    assert delta["epd_router_prompt_tokens_total"] == usage["prompt_tokens"]


def samples(collector: PoolMetrics) -> dict[tuple[str, tuple[str, ...]], float]:
    return {(s.name, tuple(s.labels.values())): s.value for family in collector.collect() for s in family.samples}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pool_metrics_reads_load_health_buckets_and_picks():
    async def scrape() -> dict:
        clock = FakeClock()
        policy = PrefillBuckets(bounds=(100,), caps=(0, 0), round_s=10.0, clock=clock)
        prefill = InstancePool("prefill", ("10.0.0.1:1", "10.0.0.2:1"), lambda channel: None, policy)
        decode = InstancePool("decode", ("10.0.0.3:1", "10.0.0.4:1"), lambda channel: None,
                              make_policy("round_robin"))
        try:
            p0, p1 = prefill.instances
            p0.instance_id, p0.load = "prefill-0", LoadReport(
                "prefill-0", "prefill", num_running=2, num_waiting=3, num_queued_prefill_tokens=500,
                num_kv_tokens_in_use=700, num_free_blocks=40, num_restarts=2)
            p0.report_at = time.monotonic()
            p1.is_drained = True
            d0, d1 = decode.instances
            d0.instance_id, d0.load = "decode-0", LoadReport("decode-0", "decode", num_running=5, num_free_blocks=9)
            d0.report_at = time.monotonic()
            d1.is_broken = True
            prefill.pick(RequestView("a", 50))  # round 1: bucket 0 demands 50 tokens' compute
            clock.now = 11.0
            prefill.pick(RequestView("b", 50))  # round 2 divides the available fleet by round 1
            decode.pick()
            return samples(PoolMetrics({"prefill": prefill, "decode": decode}))
        finally:
            await prefill.close()
            await decode.close()

    got = asyncio.run(scrape())
    demand_s = PrefillCost().prompt_seconds(50)
    assert got == {
        ("epd_router_instance_healthy", ("prefill", "prefill-0")): 1.0,
        ("epd_router_instance_healthy", ("prefill", "10.0.0.2:1")): 1.0,
        ("epd_router_instance_healthy", ("decode", "decode-0")): 1.0,
        ("epd_router_instance_healthy", ("decode", "10.0.0.4:1")): 0.0,
        ("epd_router_instance_draining", ("prefill", "prefill-0")): 0.0,
        ("epd_router_instance_draining", ("prefill", "10.0.0.2:1")): 1.0,
        ("epd_router_instance_draining", ("decode", "decode-0")): 0.0,
        ("epd_router_instance_draining", ("decode", "10.0.0.4:1")): 0.0,
        ("epd_router_instance_running_requests", ("prefill", "prefill-0")): 2.0,
        ("epd_router_instance_running_requests", ("decode", "decode-0")): 5.0,
        ("epd_router_instance_waiting_requests", ("prefill", "prefill-0")): 3.0,
        ("epd_router_instance_waiting_requests", ("decode", "decode-0")): 0.0,
        ("epd_router_instance_queued_prefill_tokens", ("prefill", "prefill-0")): 500.0,
        ("epd_router_instance_queued_prefill_tokens", ("decode", "decode-0")): 0.0,
        ("epd_router_instance_kv_tokens", ("prefill", "prefill-0")): 700.0,
        ("epd_router_instance_kv_tokens", ("decode", "decode-0")): 0.0,
        ("epd_router_instance_free_blocks", ("prefill", "prefill-0")): 40.0,
        ("epd_router_instance_free_blocks", ("decode", "decode-0")): 9.0,
        ("epd_router_instance_restarts", ("prefill", "prefill-0")): 2.0,
        ("epd_router_instance_restarts", ("decode", "decode-0")): 0.0,
        # Only prefill-0 is available (10.0.0.2:1 is drained): bucket 0 has the demand, so it.
        ("epd_router_bucket_instances", ("0",)): 1.0,
        ("epd_router_bucket_instances", ("1",)): 0.0,
        ("epd_router_bucket_demand_seconds", ("0",)): demand_s,
        ("epd_router_bucket_demand_seconds", ("1",)): 0.0,
        ("epd_router_bucket_backlog_seconds", ("0",)): 0.0,  # both picked at once: nothing waited
        ("epd_router_bucket_backlog_seconds", ("1",)): 0.0,
        ("epd_router_picks_total", ("prefill", "prefill_buckets")): 2.0,
        ("epd_router_picks_total", ("decode", "round_robin")): 1.0,
    }


def test_register_pool_metrics_once_then_follows_the_latest_pools():
    async def register_twice() -> tuple:
        first = InstancePool("decode", ("10.0.0.5:1",), lambda channel: None, make_policy("round_robin"))
        second = InstancePool("decode", ("10.0.0.6:1",), lambda channel: None, make_policy("round_robin"))
        try:
            collector = register_pool_metrics({"decode": first})
            again = register_pool_metrics({"decode": second})
            return collector, again, REGISTRY.get_sample_value(
                "epd_router_instance_healthy", {"role": "decode", "instance_id": "10.0.0.6:1"})
        finally:
            register_pool_metrics({})  # later scrapes in this process see no closed pools
            await first.close()
            await second.close()

    collector, again, healthy = asyncio.run(register_twice())
    assert again is collector and healthy == 1.0
