"""Graceful drain: a decode instance told to stop (SIGTERM) finishes the stream it serves, takes
no new work (the router sends it elsewhere), and exits 0; a prefill instance waits until the KV it
lent is released (serving the Release), then exits 0, as an encoder does. None waits for the
router's load watch, which hears of the drain at once."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from services.common.sampling_params import SamplingParams
from services.common.server import wait_for_health
from services.common.wire import RequestSpec, spec_to_proto
from services.launcher import free_port
from services.pb import common_pb2, encoder_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.cluster import running_cluster
from tests.factories import random_prompts


def sigterm_while_watched(stub, process) -> None:
    """SIGTERM to ``process`` while a router's load watch follows it (at an interval longer than
    the test's deadline): the watch is told of the drain at once, not at its next interval."""
    watch = stub.WatchLoad(common_pb2.WatchLoadRequest(interval_s=600), timeout=60)
    assert not next(watch).is_draining
    process.send_signal(signal.SIGTERM)
    assert next(watch).is_draining


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
            # One sent there before the router heard it drains is refused and moves on, as a
            # drain (planned), never as a broken stream.
            assert cluster.metric("router", "epd_router_migrations_total", reason="broken") == 0
            events = [json.loads(line.removeprefix("data: ")) for line in lines
                      if line.startswith("data: {")]
        # The stream it was serving ran to its end.
        assert events[-1]["usage"]["completion_tokens"] == 1000
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        # Well inside its drain_timeout_s (30 s): the router's load watch did not hold the drain.
        assert draining.process.wait(timeout=20) == 0


def test_a_draining_prefill_serves_the_release_of_its_lent_kv_and_then_exits(tiny_chat_model_dir):
    with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=1, decodes=1,
                         kv_cache_gib=0.05, device="cpu") as cluster:
        prefill = next(c for c in cluster.cluster.children if c.name.startswith("prefill"))
        spec = RequestSpec("lent-kv", tuple(random_prompts(1, [40], vocab=49152, seed=4)[0]),
                           SamplingParams(max_tokens=8, ignore_eos=True))
        with grpc.insecure_channel(prefill.address) as channel:
            stub = prefill_pb2_grpc.PrefillStub(channel)
            reply = stub.Prefill(prefill_pb2.PrefillRequest(spec=spec_to_proto(spec)), timeout=60)
            assert reply.kv.lease_id  # as the router hands it to a decode instance
            sigterm_while_watched(stub, prefill.process)
            with pytest.raises(grpc.RpcError) as refused:  # draining: no new work (soon after the signal)
                for _ in range(500):
                    stub.Prefill(prefill_pb2.PrefillRequest(spec=spec_to_proto(spec)), timeout=60)
                    time.sleep(0.01)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            time.sleep(0.5)
            assert prefill.process.poll() is None  # still up: its lent KV has not been taken
            released = stub.Release(prefill_pb2.ReleaseRequest(lease_id=reply.kv.lease_id), timeout=10)
            assert released.released
        # Well inside its drain_timeout_s and lease TTL (30 s each): the release let it go.
        assert prefill.process.wait(timeout=20) == 0


def test_a_draining_encoder_tells_its_watchers_at_once_and_exits(tiny_chat_model_dir):
    port = free_port("127.0.0.1")
    encoder = subprocess.Popen([sys.executable, "-m", "services.encoder", "--host", "127.0.0.1", "--port", str(port),
                                "--metrics-port", "none", "--model", str(tiny_chat_model_dir), "--image-size", "64"])
    try:
        assert asyncio.run(wait_for_health(f"127.0.0.1:{port}", "epd.v1.Encoder", timeout_s=60))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            sigterm_while_watched(encoder_pb2_grpc.EncoderStub(channel), encoder)
        assert encoder.wait(timeout=20) == 0
    finally:
        encoder.kill()
        encoder.wait()
