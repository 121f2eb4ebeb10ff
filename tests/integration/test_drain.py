"""Graceful drain: a decode instance told to stop (SIGTERM) finishes the stream it serves, takes
no new work (the router sends it elsewhere), and exits 0."""

from __future__ import annotations

import json
import signal

import httpx

from tests.cluster import running_cluster
from tests.factories import random_prompts


def test_sigterm_drains_a_decode_instance(tiny_chat_model_dir):
    with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=1, decodes=2,
                         kv_cache_gib=0.05, device="cpu") as cluster:
        body = {"model": "tiny-chat0", "prompt": random_prompts(1, [100], vocab=49152, seed=3)[0],
                "max_tokens": 1000, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=120) as client, \
                client.stream("POST", cluster.url + "/v1/completions", json=body) as reply:
            lines = reply.iter_lines()
            next(lines)
            busy = [r.instance_id for r in cluster.loads() if r.role == "decode" and r.num_running == 1]
            assert len(busy) == 1
            draining = next(c for c in cluster.cluster.children if c.name == busy[0])
            other = next(c.name for c in cluster.cluster.children if c.name.startswith("decode") and c is not draining)
            taken_before = cluster.metric(other, "epd_kv_transfers_total")
            draining.process.send_signal(signal.SIGTERM)
            # While it drains, new requests still succeed: the router sends them to the other one.
            others = [httpx.post(cluster.url + "/v1/completions", timeout=60, json={
                "model": "tiny-chat0", "prompt": "Hello", "max_tokens": 3}) for _ in range(4)]
            assert [r.status_code for r in others] == [200] * 4
            assert cluster.metric(other, "epd_kv_transfers_total") == taken_before + 4
            events = [json.loads(line.removeprefix("data: ")) for line in lines
                      if line.startswith("data: {")]
        # The stream it was serving ran to its end.
        assert events[-1]["usage"]["completion_tokens"] == 1000
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert draining.process.wait(timeout=30) == 0
