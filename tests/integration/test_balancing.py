"""The router's balancers and admin API on a live cluster (2 prefill, 2 decode): drained and
dead instances get no new work, nothing fails because of them, and the admin API steers it."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time

import httpx
import pytest

from tests.cluster import running_cluster
from tests.factories import random_prompts

TOKEN = "test-admin-token"


@pytest.fixture(scope="module")
def cluster(tiny_chat_model_dir):
    with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=2, decodes=2, kv_cache_gib=0.05,
                         max_num_batched_tokens=64, device="cpu", kvstores=0, admin_token=TOKEN) as running:
        yield running


def admin(cluster, method: str, path: str, token: str = TOKEN, **kwargs) -> httpx.Response:
    url = f"http://127.0.0.1:{cluster.cluster.config.admin_port}{path}"
    return httpx.request(method, url, headers={"Authorization": f"Bearer {token}"}, timeout=10, **kwargs)


def complete(cluster, prompt: list[int], max_tokens: int = 8) -> dict:
    reply = httpx.post(cluster.url + "/v1/completions", timeout=120, json={
        "model": "tiny-chat0", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_admin_api_needs_its_token(cluster):
    assert admin(cluster, "GET", "/admin/instances", token="wrong").status_code == 401
    no_header = httpx.get(f"http://127.0.0.1:{cluster.cluster.config.admin_port}/admin/instances", timeout=10)
    assert no_header.status_code == 401 and no_header.json()["error"]["type"] == "authentication_error"
    listed = admin(cluster, "GET", "/admin/instances").json()
    assert sorted((i["role"], i["id"]) for i in listed) == [
        ("decode", "decode-0"), ("decode", "decode-1"), ("prefill", "prefill-0"), ("prefill", "prefill-1")]
    assert all(i["healthy"] and not i["draining"] and i["load"] is not None for i in listed)
    spec = httpx.get(f"http://127.0.0.1:{cluster.cluster.config.admin_port}/admin/openapi.json", timeout=10).json()
    assert "/admin/instances/{instance_id}/drain" in spec["paths"]


def test_policies_and_buckets_change_at_run_time(cluster):
    policies = admin(cluster, "GET", "/admin/policies").json()
    assert policies["roles"]["prefill"]["policy"] == "prefill_buckets"
    assert policies["roles"]["decode"]["policy"] == "decode_balance"
    buckets = admin(cluster, "GET", "/admin/prefill/buckets").json()
    assert len(buckets["bounds"]) == 3 and buckets["round_s"] > 0
    changed = admin(cluster, "PUT", "/admin/prefill/buckets", json={"bounds": [100, 200, 300], "round_s": 1.5})
    assert changed.status_code == 200 and changed.json()["bounds"] == [100, 200, 300]
    bad = admin(cluster, "PUT", "/admin/prefill/buckets", json={"bounds": [300, 200, 100]})
    assert bad.status_code == 400 and "bounds" in bad.json()["error"]["message"]
    assert admin(cluster, "PUT", "/admin/policies/decode", json={"policy": "nope"}).status_code == 400
    assert admin(cluster, "PUT", "/admin/policies/decode", json={"policy": "least_requests"}).json()[
        "policy"] == "least_requests"
    complete(cluster, random_prompts(1, [40], vocab=49152, seed=1)[0])
    assert admin(cluster, "GET", "/admin/policies").json()["roles"]["decode"]["picks"]["least_requests"] >= 1
    admin(cluster, "PUT", "/admin/policies/decode", json={"policy": "decode_balance"})
    # The cache-aware baseline sees the router's block hashes: a repeated prompt matches its prefix.
    admin(cluster, "PUT", "/admin/policies/prefill", json={"policy": "cache_aware"})
    prompt = random_prompts(1, [200], vocab=49152, seed=3)[0]
    complete(cluster, prompt)
    complete(cluster, prompt)
    last = admin(cluster, "GET", "/admin/policies").json()["roles"]["prefill"]["last_pick"]
    assert last["breakdown"]["matched_blocks"] == 200 // 16
    admin(cluster, "PUT", "/admin/policies/prefill", json={"policy": "prefill_buckets"})
    assert admin(cluster, "GET", "/admin/prefill/buckets").json()["bounds"] == buckets["bounds"]  # scaled again


def test_a_drained_decode_instance_gets_no_new_request_and_finishes_its_own(cluster):
    before = {d: cluster.metric(d, "epd_kv_transfers_total", result="done") for d in ("decode-0", "decode-1")}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long_one = pool.submit(complete, cluster, random_prompts(1, [30], vocab=49152, seed=2)[0], 1500)
        deadline = time.monotonic() + 30
        while not (busy := [r.instance_id for r in cluster.loads() if r.role == "decode" and r.num_running]):
            assert time.monotonic() < deadline, "the long request never reached a decode instance"
            time.sleep(0.05)
        victim = busy[0]
        other = "decode-1" if victim == "decode-0" else "decode-0"
        assert admin(cluster, "POST", f"/admin/instances/{victim}/drain").json()["drained"] is True
        for i in range(6):
            complete(cluster, random_prompts(1, [20], vocab=49152, seed=10 + i)[0])
        assert long_one.result(timeout=300)["choices"][0]["finish_reason"] == "length"  # finished there
    after = {d: cluster.metric(d, "epd_kv_transfers_total", result="done") for d in ("decode-0", "decode-1")}
    assert after[victim] - before[victim] == 1 and after[other] - before[other] == 6
    admin(cluster, "POST", f"/admin/instances/{victim}/undrain")
    for i in range(4):
        complete(cluster, random_prompts(1, [20], vocab=49152, seed=20 + i)[0])
    assert cluster.metric(victim, "epd_kv_transfers_total", result="done") > after[victim]  # back in the rotation
    assert cluster.leftovers() == []


def test_prefill_requests_wait_in_the_routers_bucket_queues_and_skip_a_drained_instance(cluster):
    # Room 0: an instance takes a waiting request only once it has nothing queued, so a burst
    # waits at the router; prefill-1 drained gets none of it.
    assert admin(cluster, "PUT", "/admin/prefill/buckets", json={"room_s": 0}).json()["room_s"] == 0
    admin(cluster, "POST", "/admin/instances/prefill-1/drain")
    counts = {p: cluster.metric(p, "epd_engine_queue_time_seconds_count") for p in ("prefill-0", "prefill-1")}
    waited = cluster.metric("router", "epd_router_queue_wait_seconds_count")
    waited_s = cluster.metric("router", "epd_router_queue_wait_seconds_sum")
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda i: complete(cluster, random_prompts(1, [400], vocab=49152, seed=60 + i)[0], 2),
                                range(6)))
    assert all(r["choices"][0]["finish_reason"] == "length" for r in replies)
    assert cluster.metric("prefill-0", "epd_engine_queue_time_seconds_count") == counts["prefill-0"] + 6
    assert cluster.metric("prefill-1", "epd_engine_queue_time_seconds_count") == counts["prefill-1"]
    assert cluster.metric("router", "epd_router_queue_wait_seconds_count") == waited + 6
    # Six prompts taken one or two at a time by one instance: they waited at the router, in all
    # several prefills' time (each is 7 engine steps here), far above the 10 ms asked.
    assert cluster.metric("router", "epd_router_queue_wait_seconds_sum") - waited_s > 0.01
    assert admin(cluster, "GET", "/admin/prefill/buckets").json()["waiting"] == {}
    admin(cluster, "POST", "/admin/instances/prefill-1/undrain")
    admin(cluster, "PUT", "/admin/prefill/buckets", json={"room_s": 0.1})
    assert cluster.leftovers() == []


def test_a_killed_prefill_instance_stops_getting_work_and_no_request_fails(cluster):
    victim = next(c for c in cluster.cluster.children if c.name == "prefill-1")
    victim.process.kill()
    victim.process.wait()
    deadline = time.monotonic() + 5
    while next(i for i in admin(cluster, "GET", "/admin/instances").json() if i["id"] == "prefill-1")["healthy"]:
        assert time.monotonic() < deadline, "the router still thinks the killed instance is healthy after 5 s"
        time.sleep(0.1)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda i: complete(cluster, random_prompts(1, [24], vocab=49152, seed=40 + i)[0]),
                                range(8)))
    assert all(r["choices"][0]["finish_reason"] == "length" for r in replies)


def test_epd_admin_cli_lists_and_drains(cluster):
    env = {"EPD_ROUTER_ADMIN_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"}
    url = f"http://127.0.0.1:{cluster.cluster.config.admin_port}"
    listed = subprocess.run([sys.executable, "-m", "services.cli", "admin", "--url", url, "instances"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert listed.returncode == 0 and '"decode-0"' in listed.stdout
    bad = subprocess.run([sys.executable, "-m", "services.cli", "admin", "--url", url, "drain", "nobody"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 1 and "404" in bad.stderr and "nobody" in bad.stderr
