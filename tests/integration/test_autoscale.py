"""``epd up --autoscale``: a burst makes the router's planner ask for another decode process,
which epd up starts and the router then sends work; once the burst is over it is drained and
stopped. No request fails along the way."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.cluster import SteadyLoad, running_cluster

TOKEN = "autoscale-token"
PLANNER = {
    "interval_s": 0.5, "scale_up_window_s": 1.0, "scale_down_window_s": 4.0, "trend_window_s": 0,
    # the reference decode cost model is a GPU's: here a decode instance is "full" at 2 requests
    "decode_max_running": 2, "decode_running_target": 1.0,
    "roles": {"decode": {"min_replicas": 1, "max_replicas": 2}},
}


def long_requests(url: str, num_threads: int, stop: threading.Event, errors: list[str]) -> list[threading.Thread]:
    """Requests of 200 tokens back to back from each thread, until ``stop``."""
    def send() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                reply = client.post(url + "/v1/completions", json={
                    "model": "tiny-chat0", "prompt": "river stone cloud lamp", "max_tokens": 200,
                    "ignore_eos": True, "temperature": 0})
                if reply.status_code != 200:
                    errors.append(f"{reply.status_code}: {reply.text[:200]}")

    threads = [threading.Thread(target=send, daemon=True) for _ in range(num_threads)]
    for thread in threads:
        thread.start()
    return threads


def test_a_burst_starts_a_decode_process_that_serves_and_is_drained_and_stopped_after(
        tiny_chat_model_dir, tmp_path):
    config = tmp_path / "planner.json"
    config.write_text(json.dumps(PLANNER))
    with running_cluster(str(tiny_chat_model_dir), supervise=True, encoders=0, prefills=1, decodes=1,
                         kv_cache_gib=0.05, device="cpu", admin_token=TOKEN, autoscale=True,
                         planner_config=str(config), autoscale_max=2) as running, \
            httpx.Client(base_url=f"http://127.0.0.1:{running.cluster.config.admin_port}/admin",
                         headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as admin:
        cluster = running.cluster
        stop, errors = threading.Event(), []
        with SteadyLoad(running.url, num_threads=1) as load:
            burst = long_requests(running.url, 6, stop, errors)
            deadline = time.monotonic() + 120
            while "decode-1" not in {i["id"] for i in admin.get("/instances").json()}:
                assert time.monotonic() < deadline, f"no second decode: {admin.get('/planner').json()}"
                time.sleep(0.2)
            planner = admin.get("/planner").json()
            assert planner["mode"] == "launcher"
            assert any(h["role"] == "decode" and h["desired"] == 2 for h in planner["history"]), planner
            while running.metric("decode-1", "epd_kv_transfers_total") == 0:
                assert time.monotonic() < deadline, "the new decode process got no work"
                time.sleep(0.2)
            stop.set()
            for thread in burst:
                thread.join()
            quiet = time.monotonic()
            while [c.name for c in cluster.role_children("decode")] != ["decode-0"]:
                assert time.monotonic() - quiet < 90, f"decode-1 not stopped: {admin.get('/instances').json()}"
                time.sleep(0.2)
            load.wait_for(5, since=time.monotonic())
        assert errors == [] and load.failures() == [], (errors[:3], load.failures()[:3])
        assert {i["id"] for i in admin.get("/instances").json()} == {"prefill-0", "decode-0"}
        history = admin.get("/planner").json()["history"]
        assert [(h["current"], h["desired"]) for h in history if h["role"] == "decode"][-1] == (2, 1)
        assert running.leftovers() == []
