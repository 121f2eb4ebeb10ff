"""Live membership on the local cluster: while the router serves a steady stream, a decode
instance joins and a prefill instance leaves through the admin API, and no request fails."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.cluster import SteadyLoad, running_cluster

TOKEN = "membership-token"


def test_a_decode_joins_and_a_prefill_leaves_under_load_with_no_failed_request(tiny_chat_model_dir):
    with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=2, decodes=1, kv_cache_gib=0.05,
                         device="cpu", admin_token=TOKEN) as running, \
            httpx.Client(base_url=f"http://127.0.0.1:{running.cluster.config.admin_port}/admin",
                         headers={"Authorization": f"Bearer {TOKEN}"}, timeout=90) as admin:
        cluster = running.cluster

        def instances() -> dict[str, dict]:
            return {i["id"]: i for i in admin.get("/instances").json()}

        with SteadyLoad(running.url, num_threads=2) as load:
            began = time.monotonic()
            load.wait_for(10, since=began)

            # A decode instance joins: started here, then registered through the admin API.
            child = cluster.spawn_instance("decode")
            asyncio.run(child.wait_healthy(120))
            added = admin.post("/instances", json={"role": "decode", "address": child.address,
                                                   "instance_id": child.name})
            assert added.status_code == 201, added.text
            joined = time.monotonic()
            while running.metric(child.name, "epd_kv_transfers_total") == 0:
                assert time.monotonic() - joined < 15, "the new decode instance got no work within 15 s"
                time.sleep(0.1)
            assert instances()[child.name]["source"] == "admin"

            # A prefill instance leaves: the router stops sending to it, answers once this
            # router's requests on it are done, and only then is the process stopped.
            left_at = time.monotonic()
            removed = admin.delete("/instances/prefill-0", params={"wait": "true"})
            assert removed.status_code == 200 and removed.json()["removed"] is True, removed.text
            assert "prefill-0" not in instances()
            gone = cluster.child("prefill-0")
            asyncio.run(cluster.stop_child(gone))
            assert gone.process.returncode == 0          # it drained and exited on its own
            load.wait_for(10, since=time.monotonic())
        assert load.failures() == [], load.failures()[:3]
        assert load.num_served(since=left_at) >= 10
        assert sorted(instances()) == ["decode-0", "decode-1", "prefill-1"]
        assert running.leftovers() == []
