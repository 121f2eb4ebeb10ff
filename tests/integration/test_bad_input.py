"""Bad input against a real router process in front of a real cluster: four ~10 MB chat bodies at
once are refused quickly and cheaply (each once took ~20 s and ~2.5 GB of router memory; four got
the router OOM-killed), the router serves normally afterwards, and a seed past int64 or lone
surrogates in the text are 400s, not 500s."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.cluster import running_cluster

MAX_SECONDS = 10.0
"""Per refused request, on a slow shared 2-core machine (measured: ~1-3 s)."""
MAX_ROUTER_MIB = 500
"""The router's peak resident memory, from its start to the end of the test (measured: ~200 MiB)."""
HEADERS = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def cluster(tiny_chat_model_dir):
    with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=1, decodes=1, kvstores=0,
                         kv_cache_gib=0.05, device="cpu") as running:
        yield running


def status_mib(pid: int, field: str) -> float:
    """VmRSS (resident now) or VmHWM (the peak since the process started) of ``pid``, in MiB."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


class RSSSampler:
    """Samples a process's resident memory every 10 ms while running."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_mib, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, status_mib(self.pid, "VmRSS"))
            self._stop.wait(0.01)

    def __enter__(self) -> RSSSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def ten_megabyte_chat_body() -> bytes:
    words = "the quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat "
    content = (words * (10_000_000 // len(words) + 1))[:10_000_000]
    body = json.dumps({"messages": [{"role": "user", "content": content}]}).encode()
    assert 10_000_000 < len(body) < 16 * 1024 * 1024  # under the router's --max-body-bytes
    return body


def test_four_ten_megabyte_bodies_at_once_are_cheap_400s(cluster):
    router = next(c for c in cluster.cluster.children if c.name == "router").process
    body = ten_megabyte_chat_body()
    start_mib = status_mib(router.pid, "VmRSS")

    def send(_) -> tuple[float, httpx.Response]:
        started = time.monotonic()
        response = httpx.post(cluster.url + "/v1/chat/completions", content=body, headers=HEADERS, timeout=120)
        return time.monotonic() - started, response

    with RSSSampler(router.pid) as sampler, ThreadPoolExecutor(4) as pool:
        results = list(pool.map(send, range(4)))
    peak_mib = max(sampler.peak_mib, status_mib(router.pid, "VmHWM"))
    seconds = [s for s, _ in results]
    print(f"\nrouter RSS: {start_mib:.0f} MiB before, peak {peak_mib:.0f} MiB (sampled {sampler.peak_mib:.0f}); "
          f"seconds per request: {', '.join(f'{s:.2f}' for s in seconds)}")
    for _, response in results:
        assert response.status_code == 400, response.text[:300]
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error", "context_length_exceeded", "messages")
        assert error["message"].startswith("the prompt is at least ")
        assert "this model's context is 4096 tokens" in error["message"]
    assert max(seconds) < MAX_SECONDS
    assert peak_mib < MAX_ROUTER_MIB
    assert router.poll() is None

    reply = httpx.post(cluster.url + "/v1/chat/completions", headers=HEADERS, timeout=120, json={
        "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1


def test_a_seed_past_int64_and_lone_surrogates_are_400s(cluster):
    def post(path: str, raw: str) -> httpx.Response:
        return httpx.post(cluster.url + path, content=raw.encode(), headers=HEADERS, timeout=60)

    seeded = post("/v1/chat/completions",
                  '{"messages": [{"role": "user", "content": "hi"}], "seed": 1180591620717411303424}')
    assert seeded.status_code == 400 and seeded.json()["error"]["param"] == "seed"
    surrogates = '"\\ud800 ... \\udfff"'
    model = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    chat = post("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {surrogates}}}]}}')
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages[0].content"
    assert "not valid Unicode" in chat.json()["error"]["message"]
    messages = post("/v1/messages", f'{{"model": "{model}", "max_tokens": 5, "system": {surrogates}, '
                                    f'"messages": [{{"role": "user", "content": "hi"}}]}}')
    assert messages.status_code == 400 and messages.json()["type"] == "error"
    assert messages.json()["error"]["message"].startswith("system is not valid Unicode")
    reply = httpx.post(cluster.url + "/v1/completions", headers=HEADERS, timeout=120,
                       json={"prompt": "Hello", "max_tokens": 3, "seed": 2**63 - 1})
    assert reply.status_code == 200
