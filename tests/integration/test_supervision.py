"""Supervision on a live cluster (2 prefill, 2 decode, 2 store nodes with 2 replicas): each kind
of child killed with SIGKILL under a steady load of new chat requests comes back on its address,
with its restart count, and serves again within seconds; no new request fails meanwhile (the
router's own restart excepted: while it is down nobody can connect)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import grpc
import httpx
import pytest

from services.pb import kvstore_pb2, kvstore_pb2_grpc
from tests.cluster import RunningCluster, SteadyLoad, running_cluster

TOKEN = "test-admin-token"
RECOVERY_S = 60.0
"""Generous bound on a restart (model load included) for a shared, busy test machine."""
LEASE_TTL_S = 5.0
"""A prefill's lease on KV it handed over: a request whose router died between prefill and
decode leaves its lease to expire (30 s by default; shortened here to keep the test quick)."""


@pytest.fixture(scope="module")
def cluster(tiny_chat_model_dir):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EPD_PREFILL_LEASE_TTL_S", str(LEASE_TTL_S))  # the children inherit it
        with running_cluster(str(tiny_chat_model_dir), supervise=True, encoders=0, prefills=2, decodes=2,
                             kvstores=2, kvstore_replicas=2, kv_cache_gib=0.05, max_num_batched_tokens=64,
                             device="cpu", prefill_policy="round_robin", decode_policy="round_robin",
                             admin_token=TOKEN) as running:
            yield running


def admin(cluster: RunningCluster, path: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{cluster.cluster.config.admin_port}{path}",
                     headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)


def listed(cluster: RunningCluster, instance_id: str) -> dict:
    return next(i for i in admin(cluster, "/admin/instances").json() if i["id"] == instance_id)


def seconds_until(condition: Callable[[], bool], since: float, timeout_s: float = RECOVERY_S) -> float:
    """Seconds from ``since`` until ``condition()`` held (polled every 50 ms)."""
    while True:
        try:
            if condition():
                return time.monotonic() - since
        except (httpx.HTTPError, grpc.RpcError, StopIteration):
            pass  # not back yet
        assert time.monotonic() - since < timeout_s, "not back in time"
        time.sleep(0.05)


def store_blocks(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return kvstore_pb2_grpc.KVStoreStub(channel).GetStats(kvstore_pb2.StoreStatsRequest(), timeout=2).num_blocks


SERVES_AGAIN: dict[str, Callable[[RunningCluster, str], bool]] = {
    "prefill": lambda cluster, name: cluster.metric(name, "epd_engine_queue_time_seconds_count") > 0,
    "decode": lambda cluster, name: cluster.metric(name, "epd_kv_transfers_total", result="done") > 0,
    "kvstore": lambda cluster, name: store_blocks(cluster.cluster.child(name).address) > 0,
}
"""A restarted child's metrics start from zero: any work on them is work since its restart."""


def kill_under_load(cluster: RunningCluster, name: str) -> tuple[SteadyLoad, dict[str, float], float]:
    """SIGKILL ``name`` under a steady load; (the load, seconds from the kill to each stage of its
    recovery, the kill's time). The load runs on for a while after it is back."""
    child = cluster.cluster.child(name)
    old_pid, address, restarts = child.process.pid, child.address, child.num_restarts
    role = name.split("-")[0]
    times: dict[str, float] = {}
    with SteadyLoad(cluster.url) as load:
        time.sleep(1.5)
        assert load.failures() == [] and load.num_served(0) > 0, load.failures()
        killed_at = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        times["restarted (healthy)"] = seconds_until(
            lambda: child.process.pid != old_pid and child.healthy_since is not None, killed_at)
        assert child.address == address and child.num_restarts == restarts + 1
        if role in ("prefill", "decode"):
            times["router took it back"] = seconds_until(
                lambda: listed(cluster, name)["healthy"] and listed(cluster, name)["restarts"] == restarts + 1,
                killed_at)
        if role == "router":  # nothing can reach a dead router: a request served is one served by the new one
            times["serving"] = seconds_until(lambda: load.num_served(since=killed_at) > 0, killed_at)
        else:
            times["serving"] = seconds_until(lambda: SERVES_AGAIN[role](cluster, name), killed_at)
        time.sleep(1.5)
    print(f"\n{name} killed (pid {old_pid}, {len(load.outcomes)} requests sent): "
          + ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in times.items()))
    return load, times, killed_at


@pytest.mark.parametrize("name", ["prefill-1", "decode-1", "kvstore-1"])
def test_a_killed_instance_or_store_node_comes_back_and_no_new_request_fails(cluster, name):
    load, times, killed_at = kill_under_load(cluster, name)
    assert load.failures(since=killed_at) == [], [o.error for o in load.failures(since=killed_at)]
    in_flight = [o.error for o in load.failures(until=killed_at)]
    print(f"{name}: {len(in_flight)} request(s) in flight at the kill failed {in_flight}")
    if not name.startswith("decode"):
        # The router retries a failed prefill elsewhere, and a store node's loss only costs hits.
        # A decode's loss fails the requests streaming from it unless the router moves them
        # (mid-stream migration, services/router/cluster/pipeline.py).
        assert in_flight == []
    assert times["serving"] < RECOVERY_S
    assert cluster.metric(name, "epd_process_restarts") == 1
    if not name.startswith("kvstore"):
        assert listed(cluster, name)["restarts"] == 1
    assert cluster.leftovers() == []


def test_a_killed_router_comes_back_and_serves(cluster):
    load, times, killed_at = kill_under_load(cluster, "router")
    back_at = killed_at + times["restarted (healthy)"]
    assert load.failures(since=back_at) == [], [o.error for o in load.failures(since=back_at)]
    assert load.num_served(back_at) > 0
    assert times["restarted (healthy)"] < RECOVERY_S
    assert admin(cluster, "/admin/router").json() == {"pid": cluster.cluster.child("router").process.pid,
                                                      "restarts": 1}
    assert cluster.metric("router", "epd_process_restarts") == 1
    # The new router heard each instance's count from its first load report.
    assert {i["id"]: i["restarts"] for i in admin(cluster, "/admin/instances").json()} == {
        c.name: c.num_restarts for c in cluster.cluster.children if c.name.startswith(("prefill", "decode"))}
    # A request prefilled when the router died never reached a decode: its lease expires.
    print("leases held when the router came back:", {r.instance_id: r.num_leases for r in cluster.loads()})
    assert cluster.leftovers(timeout_s=LEASE_TTL_S + 10) == []
