"""Kubernetes discovery in a running router: EndpointSlices appearing, turning not ready and
vanishing move real instances into and out of a real router (``--discovery kubernetes``, a
kubeconfig pointing at the API emulator) while requests keep flowing, none of them failing."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable

import httpx

from services.launcher import Cluster, UpConfig, free_port
from services.supervisor import Child, Probe
from tests.cluster import RunningCluster, SteadyLoad
from tests.unit.router.k8s_emulator import EmulatorThread, endpoint, endpoint_slice, write_kubeconfig

TOKEN = "k8s-discovery-test"
TAKEN = {"prefill": "epd_engine_queue_time_seconds_count", "decode": "epd_kv_transfers_total"}
"""What counts the requests an instance took: a prefill engine's queue times, a decode
instance's KV hand-overs."""


def taken(running: RunningCluster, name: str) -> float:
    return running.metric(name, TAKEN[name.split("-")[0]])


def slice_of(child: Child, role: str, *, ready: bool = True) -> dict:
    """The EndpointSlice Kubernetes would keep for the pod running ``child``."""
    host, port = child.address.rsplit(":", 1)
    return endpoint_slice(f"r1-{child.name}", role, [endpoint(host, child.name, ready=ready)], port=int(port))


def router_child(port: int, admin_port: int, kubeconfig: str) -> Child:
    url = f"http://127.0.0.1:{port}"
    return Child("router", f"127.0.0.1:{port}", [
        sys.executable, "-m", "services.router", "--host", "127.0.0.1", "--port", str(port),
        "--admin-port", str(admin_port), "--discovery", "kubernetes", "--k8s-namespace", "default",
        "--k8s-label-selector", "app.kubernetes.io/instance=r1",
        # Round robin: an instance that joins gets work at once (the default balancers too, later).
        "--prefill-policy", "round_robin", "--decode-policy", "round_robin"],
        Probe(http_url=url + "/health"), metrics_url=url + "/metrics",
        env={"EPD_ROUTER_ADMIN_TOKEN": TOKEN, "KUBECONFIG": kubeconfig})


async def all_healthy(*children: Child) -> None:
    await asyncio.gather(*(child.wait_healthy(600) for child in children))


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def test_slices_move_instances_into_and_out_of_a_running_router(tiny_chat_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)   # the kubeconfig, not in-cluster
    config = UpConfig(model=str(tiny_chat_model_dir), encoders=0, prefills=2, decodes=2, kvstores=0,
                      kv_cache_gib=0.05, device="cpu", port=free_port("127.0.0.1"))
    cluster = Cluster(config)
    admin_port = free_port("127.0.0.1")

    def instances() -> dict[str, dict]:
        reply = httpx.get(f"http://127.0.0.1:{admin_port}/admin/instances", timeout=10,
                          headers={"Authorization": f"Bearer {TOKEN}"})
        return {i["id"]: i for i in reply.json()}

    with EmulatorThread() as k8s:
        try:
            p0, p1 = cluster.spawn_instance("prefill"), cluster.spawn_instance("prefill")
            d0, d1 = cluster.spawn_instance("decode"), cluster.spawn_instance("decode")
            asyncio.run(all_healthy(p0, p1, d0, d1))
            k8s.call(k8s.emulator.put, "endpointslices", slice_of(p0, "prefill"))
            k8s.call(k8s.emulator.put, "endpointslices", slice_of(d0, "decode"))
            router = router_child(config.port, admin_port, write_kubeconfig(tmp_path / "kubeconfig", k8s.url))
            router.spawn()
            cluster.children.append(router)
            asyncio.run(router.wait_healthy(120))
            running = RunningCluster(f"http://{router.address}", cluster)
            assert sorted(instances()) == ["decode-0", "prefill-0"]
            assert {i["source"] for i in instances().values()} == {"kubernetes"}

            with SteadyLoad(running.url) as load:
                load.wait_for(5, since=0)
                # The second pair's slices appear: both join and get work.
                k8s.call(k8s.emulator.put, "endpointslices", slice_of(p1, "prefill"))
                k8s.call(k8s.emulator.put, "endpointslices", slice_of(d1, "decode"))
                wait_until(lambda: sorted(instances()) == ["decode-0", "decode-1", "prefill-0", "prefill-1"],
                           "the second pair in the router")
                wait_until(lambda: taken(running, "prefill-1") > 0 and taken(running, "decode-1") > 0,
                           "the second pair serving")

                # The first prefill's endpoint turns not ready: no new requests, in-flight ones finish.
                k8s.call(k8s.emulator.put, "endpointslices", slice_of(p0, "prefill", ready=False))
                wait_until(lambda: not instances()["prefill-0"]["ready"], "prefill-0 not ready")
                wait_until(lambda: instances()["prefill-0"]["in_flight"] == 0, "prefill-0 idle")
                before = taken(running, "prefill-0")
                load.wait_for(10, since=time.monotonic())
                assert taken(running, "prefill-0") == before
                assert "prefill-0" in instances()          # still known: it may turn ready again

                # The first decode's slice vanishes: drained, then gone from the router.
                k8s.call(k8s.emulator.delete, "endpointslices", "r1-decode-0")
                wait_until(lambda: "decode-0" not in instances(), "decode-0 gone")
                before = taken(running, "decode-0")
                load.wait_for(10, since=time.monotonic())
                assert taken(running, "decode-0") == before
            assert load.failures() == []
            assert len(load.outcomes) >= 25
            # The router listed once and has watched since (a 30 s resync at most once or twice).
            watches = [r for r in k8s.emulator.requests if "watch" in r.query]
            assert {r.query["labelSelector"] for r in watches} == {"app.kubernetes.io/instance=r1,epd.io/role"}
        finally:
            cluster.stop()
