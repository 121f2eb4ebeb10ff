"""Redis dies under load and comes back (a real redis-server, SIGKILLed and restarted on its port,
under a real cluster): no request fails, no store node exits, the store nodes publish their
indexes again and serve hits; with fail-closed limits a router answers 503 meanwhile."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
import redis

from services.launcher import free_port
from tests.cluster import RunningCluster, SteadyLoad, running_cluster
from tests.factories import random_prompts
from tests.integration.test_kvstore_cluster import BLOCK, complete, wait_stored

KEY = "epd-outage-test-key"
OUTAGE_S = 3.0
"""How long Redis stays down (a floor: the test also waits for requests to pass meanwhile)."""


class RedisProcess:
    """A redis-server the test kills and starts again on the same port. Its append-only file
    keeps what was written (the API keys), as a production Redis's would."""

    def __init__(self, directory) -> None:
        self.port = free_port("127.0.0.1")
        self.directory = str(directory)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", self.directory], stdout=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    assert time.monotonic() < deadline, "redis-server did not start"
                    time.sleep(0.05)  # polling a process that is starting: nothing to wait on
        finally:
            client.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)


@pytest.fixture
def own_redis(redis_url, tmp_path):
    """A redis-server of this test's own (``redis_url`` only makes sure one is installed)."""
    server = RedisProcess(tmp_path)
    server.start()
    yield server
    server.kill()


def model_name(url: str, headers: dict[str, str]) -> str:
    return httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.1)


def pids(cluster: RunningCluster) -> dict[str, int | None]:
    """Each process of the cluster (None: it has exited): a process that died, restarted or not,
    changes this."""
    return {c.name: c.process.pid if c.process.poll() is None else None for c in cluster.cluster.children}


def outage_under(load: SteadyLoad, server: RedisProcess, cluster: RunningCluster, during=None) -> None:
    """Kill Redis while ``load`` runs, keep it down OUTAGE_S (``during()`` runs then), start it
    again, and return once both store nodes found it back and more requests have passed."""
    before = pids(cluster)
    assert None not in before.values()
    load.wait_for(4, since=0.0)
    server.kill()
    killed_at = time.monotonic()
    if during is not None:
        during()
    load.wait_for(4, since=killed_at)
    time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - killed_at)))  # a dead Redis for a while, whatever the load
    assert pids(cluster) == before, "a process exited while Redis was down"
    assert cluster.metric("kvstore", "epd_redis_available") == 0
    server.start()
    back_at = time.monotonic()
    wait_until(lambda: cluster.metric("kvstore", "epd_redis_available") == 2, "the store nodes found Redis back")
    load.wait_for(4, since=back_at)
    assert pids(cluster) == before


def test_no_request_fails_without_keys_and_the_store_recovers(tiny_chat_model_dir, own_redis):
    with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=2, decodes=1, kv_cache_gib=0.05,
                         max_num_batched_tokens=64, device="cpu", kvstores=2, redis=own_redis.url,
                         kvstore_replicas=2, prefill_policy="round_robin") as cluster:
        with SteadyLoad(cluster.url, model=model_name(cluster.url, {})) as load:
            outage_under(load, own_redis, cluster)
        assert load.failures() == [] and len(load.outcomes) >= 12
        assert cluster.metric("kvstore", "epd_redis_outages_total") >= 2  # each node saw it
        # Each node published its whole index again: what Redis holds is what the node holds.
        client = redis.Redis.from_url(own_redis.url)
        try:
            def published_again() -> bool:
                return all(client.exists(f"epd:kv:n:{s.node_id}:published")
                           and client.zcard(f"epd:kv:n:{s.node_id}:exp") == s.num_blocks for s in cluster.store_stats())
            wait_until(published_again, "the store nodes re-published their indexes")
            assert sorted(m.decode() for m in client.smembers("epd:kv:nodes")) == ["kvstore-0", "kvstore-1"]
        finally:
            client.close()
        assert cluster.metric("kvstore", "epd_kvstore_index_resyncs_total") >= 2  # at least at start
        # Hits again: the same prompt on the other prefill (round robin) is read from the store.
        prompt = random_prompts(1, [320], vocab=49152, seed=41)[0]
        held = sum(s.num_blocks for s in cluster.store_stats())
        hits = cluster.metric("kvstore", "epd_kvstore_hit_blocks_total")
        first, cached = complete(cluster, prompt)
        assert cached == 0
        assert wait_stored(cluster, held + 2 * (len(prompt) // BLOCK)) >= held + 2 * (len(prompt) // BLOCK)  # two replicas
        second, cached = complete(cluster, prompt)
        assert second == first and cached >= len(prompt) - 1 - BLOCK
        assert cluster.metric("kvstore", "epd_kvstore_hit_blocks_total") >= hits + cached // BLOCK
        assert cluster.leftovers() == []


def start_router(cluster: RunningCluster, redis_url: str, **env: str) -> tuple[subprocess.Popen, str]:
    port = free_port("127.0.0.1")
    args = [arg for role in ("prefill", "decode") for address in cluster.addresses(role)
            for arg in (f"--{role}", address)]
    process = subprocess.Popen([sys.executable, "-m", "services.router", "--port", str(port), "--admin-port", "none",
                                "--redis-url", redis_url, *args], env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.poll() is None, f"the second router exited with {process.returncode}"
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    wait_until(healthy, "the second router started", 60)
    return process, url


def test_with_keys_fail_open_fails_no_request_and_fail_closed_answers_503(tiny_chat_model_dir, own_redis,
                                                                           monkeypatch):
    # Every key then has a limit, so every request asks the limiter in Redis.
    monkeypatch.setenv("EPD_ROUTER_RPM", "100000")
    with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=1, decodes=1, kv_cache_gib=0.05,
                         max_num_batched_tokens=64, device="cpu", kvstores=2, redis=own_redis.url,
                         kvstore_replicas=2, api_key=(f"outage:{KEY}",)) as cluster:
        closed, closed_url = start_router(cluster, own_redis.url, EPD_ROUTER_LIMITS_ON_REDIS_FAILURE="fail-closed")
        try:
            headers = {"Authorization": f"Bearer {KEY}"}
            chat = {"model": model_name(cluster.url, headers), "max_tokens": 2,
                    "messages": [{"role": "user", "content": "Hi"}]}
            assert httpx.post(cluster.url + "/v1/chat/completions", json=chat, timeout=60).status_code == 401
            assert httpx.post(closed_url + "/v1/chat/completions", json=chat, headers=headers,
                              timeout=60).status_code == 200  # the key is now known to that router too
            refusals = []

            def while_down() -> None:
                for _ in range(3):
                    reply = httpx.post(closed_url + "/v1/chat/completions", json=chat, headers=headers, timeout=60)
                    refusals.append(reply)

            with SteadyLoad(cluster.url, headers=headers, model=model_name(cluster.url, headers)) as load:
                outage_under(load, own_redis, cluster, during=while_down)
            assert load.failures() == [] and len(load.outcomes) >= 12
            for reply in refusals:
                assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
                error = reply.json()["error"]
                assert error["type"] == "service_unavailable_error"
                assert "the per-key limits store (Redis) is unavailable" in error["message"]

            def admitted_again() -> bool:
                reply = httpx.post(closed_url + "/v1/chat/completions", json=chat, headers=headers, timeout=60)
                assert reply.status_code in (200, 503), reply.text
                return reply.status_code == 200
            wait_until(admitted_again, "the fail-closed router admitted again")
            assert closed.poll() is None
            assert cluster.metric("router", "epd_router_limits_degraded_total", outcome="local") >= 1
            assert cluster.metric("router", "epd_redis_outages_total") >= 1
            assert httpx.post(cluster.url + "/v1/chat/completions", json=chat, timeout=60).status_code == 401
            assert cluster.leftovers() == []
        finally:
            closed.terminate()
            closed.wait(30)
