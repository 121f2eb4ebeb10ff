"""Images through the real cluster with E->P one-sided: rows lent by the encoder and read by
prefill, every lease released, the encoder cache, and the router skipping the encoder when the
image's KV is a prefix hit.

2 encoders (small images: 16 rows each), 1 prefill, 1 decode, 1 store node, all real
processes; leases (E->P and P->D) live 300 s here, so a count back at 0 is a release, never an
expiry. The router runs with the fault of tests/integration/faults (off until a test turns it on).
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import httpx
import pytest
from PIL import Image

from services.common.wire import load_from_proto
from services.pb import common_pb2, encoder_pb2, encoder_pb2_grpc
from tests.cluster import running_cluster

ROWS = 16  # (64 / 16) ** 2 patches per image
BLOCK = 16  # the engines' KV block size
TEXT = ("Describe this picture in detail, its colours, its shapes and what it might show, "
        "then say what you would call it and why, in a few short sentences please.")


FAULTS = Path(__file__).parent / "faults"


@pytest.fixture(scope="module")
def hold_prefill_reply(tmp_path_factory) -> Path:
    """While this file exists, the router holds each Prefill reply that lends KV (faults/)."""
    return tmp_path_factory.mktemp("faults") / "hold-prefill-reply"


@pytest.fixture(scope="module")
def cluster(tiny_chat_model_dir, hold_prefill_reply):
    saved = dict(os.environ)
    os.environ.update(EPD_ENCODER_IMAGE_SIZE="64", EPD_ENCODER_LEASE_TTL_S="300", EPD_PREFILL_LEASE_TTL_S="300",
                      EPD_TEST_HOLD_PREFILL_REPLY=str(hold_prefill_reply),
                      PYTHONPATH=os.pathsep.join(filter(None, (str(FAULTS), os.environ.get("PYTHONPATH")))))
    try:
        with running_cluster(str(tiny_chat_model_dir), encoders=2, prefills=1, decodes=1, kv_cache_gib=0.02,
                             device="cpu") as running:
            yield running
    finally:
        os.environ.clear()
        os.environ.update(saved)


def picture(seed: int) -> str:
    out = io.BytesIO()
    Image.new("RGB", (48, 40), (seed * 40 % 256, 90, 200 - seed)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def chat(cluster, uri: str, text: str = TEXT, max_tokens: int = 6, timeout: float = 120) -> dict:
    body = {"model": "tiny-chat0", "max_tokens": max_tokens, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": text}]}]}
    reply = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=timeout)
    assert reply.status_code == 200, reply.text
    return reply.json()


def cached(reply: dict) -> int:
    return (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def encoder_leases(cluster) -> list[int]:
    counts = []
    for address in cluster.addresses("encoder"):
        with grpc.insecure_channel(address) as channel:
            report = encoder_pb2_grpc.EncoderStub(channel).GetLoad(common_pb2.LoadRequest(), timeout=5)
            counts.append(load_from_proto(report).num_leases)
    return counts


def wait_no_leases(cluster, timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(counts := encoder_leases(cluster)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return counts


def test_rows_move_one_sided_cache_hits_and_the_encoder_is_skipped_on_a_prefix_hit(cluster):
    calls = lambda: cluster.metric("encoder", "epd_encoder_encode_calls_total")  # noqa: E731
    hits = lambda: cluster.metric("encoder", "epd_encoder_cache_total", result="hit")  # noqa: E731
    granted = cluster.metric("encoder", "epd_encoder_leases_total", event="granted")
    calls_before = calls()
    first = chat(cluster, picture(1))
    assert calls() == calls_before + 1 and wait_no_leases(cluster) == [0, 0]
    assert cluster.metric("encoder", "epd_encoder_leases_total", event="granted") == granted + 1  # rows were lent
    # The same image and text again: no Encode call at all, the image's KV from the prefix cache.
    again = chat(cluster, picture(1))
    assert calls() == calls_before + 1
    assert cluster.metric("router", "epd_router_encoder_skips_total", outcome="skipped") >= 1
    # Every full block but the last is a hit; the image sits before the long text, so inside it.
    num_prompt = again["usage"]["prompt_tokens"]
    assert cached(first) == 0 and cached(again) == (num_prompt - 1) // BLOCK * BLOCK
    assert num_prompt - cached(again) < len(TEXT) // 8  # (the text is ~35 tokens)
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    # The same image after other text: encoded again (by either encoder).
    chat(cluster, picture(1), text="Another question entirely. " + TEXT)
    assert calls() == calls_before + 2
    # The same text with another image: no false hit, the new image is encoded (a miss).
    hits_before = hits()
    other = chat(cluster, picture(2))
    assert calls() == calls_before + 3 and hits() == hits_before
    assert cached(other) <= cached(again) - ROWS  # at most the blocks before the image
    assert wait_no_leases(cluster) == [0, 0]
    assert not (held := cluster.leftovers()), "\n".join(held)


def test_the_same_image_twice_at_one_encoder_is_a_cache_hit_without_a_forward(cluster):
    for address in cluster.addresses("encoder"):
        with grpc.insecure_channel(address) as channel:
            stub = encoder_pb2_grpc.EncoderStub(channel)
            replies = [stub.Encode(encoder_pb2.EncodeRequest(images=[picture(20)], lease_id=f"l{i}"), timeout=60)
                       for i in range(2)]
            assert [r.images[0].is_cached for r in replies] == [False, True]
            assert replies[0].images[0].image_hash == replies[1].images[0].image_hash
            for i in range(2):
                assert stub.Release(encoder_pb2.ReleaseEmbeddingsRequest(lease_id=f"l{i}"), timeout=5).released
    assert cluster.metric("encoder", "epd_encoder_cache_total", result="hit") >= 2
    assert wait_no_leases(cluster) == [0, 0]


def test_leases_are_released_when_the_client_leaves_mid_request(cluster):
    left = 0
    for seed, timeout in ((3, 0.02), (4, 0.1)):  # gone while the request is encoded or prefilled
        try:
            chat(cluster, picture(seed), timeout=timeout)
        except httpx.TimeoutException:
            left += 1
    body = {"model": "tiny-chat0", "max_tokens": 400, "stream": True, "ignore_eos": True, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture(5)}},
                                     {"type": "text", "text": TEXT}]}]}
    with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        next(reply.iter_lines())  # gone while it decodes
    assert left >= 1
    assert wait_no_leases(cluster) == [0, 0]
    assert not (held := cluster.leftovers()), "\n".join(held)


def test_an_encoder_killed_mid_request_fails_no_request(cluster):
    victim = next(c for c in cluster.cluster.children if c.name.startswith("encoder"))
    with ThreadPoolExecutor(4) as pool:
        # In flight while it dies: encoding there, or its rows not yet read by prefill.
        replies = [pool.submit(chat, cluster, picture(seed)) for seed in range(6, 10)]
        time.sleep(0.05)
        os.kill(victim.process.pid, signal.SIGKILL)
        assert [r.result()["usage"]["completion_tokens"] for r in replies] == [6] * 4
    victim.process.wait(timeout=30)
    for seed in range(10, 13):  # some are first sent to the dead one: the router moves them on
        assert chat(cluster, picture(seed))["usage"]["completion_tokens"] == 6
    assert wait_no_leases(cluster) == [0]  # the survivor's; the dead one's died with it
    assert not (held := cluster.leftovers()), "\n".join(held)


def test_a_client_gone_as_its_prefill_reply_arrives_strands_no_kv(cluster, hold_prefill_reply):
    """Prefill has lent the KV and sent its reply; the client leaves before the router takes the
    reply (held there by the fault): the router must release the lease it never saw."""
    url = urlsplit(cluster.url)
    body = json.dumps({"model": "tiny-chat0", "max_tokens": 6, "temperature": 0,
                       "messages": [{"role": "user", "content": TEXT}]}).encode()
    held = Path(f"{hold_prefill_reply}.held")
    hold_prefill_reply.touch()
    try:
        with socket.create_connection((url.hostname, url.port), timeout=60) as client:
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
                           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 60
            while not held.exists():
                assert time.monotonic() < deadline, "no Prefill reply reached the router"
                time.sleep(0.02)
            assert [r.num_leases for r in cluster.loads() if r.role == "prefill"] == [1]
    finally:  # the fault off again (the client left as the with-block ended)
        hold_prefill_reply.unlink()
        held.unlink(missing_ok=True)
    assert not (held_now := cluster.leftovers()), "\n".join(held_now)
