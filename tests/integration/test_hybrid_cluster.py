"""A hybrid sliding-window model through a real cluster (2 prefill, 2 decode, 1 store node):
the prefill -> decode hand-over moves the window KV too; a prefix written by one prefill is hit
by the other with its window (the SWA tier) or, once the window is gone, by a bounded replay; a
decode killed mid-stream is resumed from the store by the other; the output equals one engine's
every time, and nothing stays held."""

from __future__ import annotations

import os
import signal
import time

import grpc
import httpx
import pytest

from services.engine import LLM, SamplingParams
from tests.cluster import running_cluster
from tests.factories import make_tiny_chat_model_dir, random_prompts
from tests.integration.test_migration import serving_decode, stream, wait_for_decodes

BLOCK, WINDOW = 16, 24
REPLAY = 2 * (WINDOW - 1)  # two sliding-window layers
SWA_TTL_S = 6.0


@pytest.fixture(scope="module")
def hybrid_chat_dir(tmp_path_factory, smollm2_dir):
    return make_tiny_chat_model_dir(tmp_path_factory.mktemp("hybrid-chat"), smollm2_dir, seed=5, arch="qwen2",
                                    num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])


@pytest.fixture(scope="module")
def cluster(hybrid_chat_dir):
    os.environ["EPD_ROUTER_DECODE_IDLE_TIMEOUT_S"] = "2"
    try:
        with running_cluster(str(hybrid_chat_dir), supervise=True, encoders=0, prefills=2, decodes=2,
                             kv_cache_gib=0.05, max_num_batched_tokens=64, device="cpu", kvstores=1,
                             prefill_policy="round_robin", swa_ttl_s=SWA_TTL_S) as running:
            yield running
    finally:
        del os.environ["EPD_ROUTER_DECODE_IDLE_TIMEOUT_S"]


@pytest.fixture(autouse=True)
def nothing_held_after_each_test(cluster):
    yield
    assert cluster.leftovers() == []


def complete(cluster, prompt: list[int], max_tokens: int = 24) -> tuple[list[int], int]:
    body = {"model": "hybrid-chat0", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    reply = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    return data["choices"][0]["token_ids"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def one_engine(model_dir, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    llm = LLM(str(model_dir), num_kv_blocks=256, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


def test_the_hand_over_moves_the_window_and_decode_continues_as_one_engine(cluster, hybrid_chat_dir):
    prompts = random_prompts(3, [7, 100, 700], vocab=49152, seed=31)
    expected = one_engine(hybrid_chat_dir, prompts)
    for prompt, tokens in zip(prompts, expected):
        assert complete(cluster, prompt)[0] == tokens, len(prompt)
    assert cluster.metric("decode", "epd_kv_handover_path_total", path="direct") >= 3
    assert cluster.metric("decode", "epd_kv_handover_path_total", path="recompute") == 0


def wait_for(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def published(cluster) -> float:
    return cluster.metric("prefill", "epd_swa_windows_total", event="published")


def test_the_other_prefill_hits_the_block_kv_and_the_window_then_replays_once_it_expired(cluster, hybrid_chat_dir):
    prompts = random_prompts(2, [1000, 1000], vocab=49152, seed=41)
    cold = one_engine(hybrid_chat_dir, prompts)
    l1 = (1000 - 1) // BLOCK * BLOCK  # 992: every full block but the last token's
    replay_start = (l1 - REPLAY) // BLOCK * BLOCK  # 944
    for prompt, expected in zip(prompts, cold):
        before = published(cluster)
        pulled = cluster.metric("prefill", "epd_swa_windows_total", event="pulled")
        first, cached = complete(cluster, prompt)
        assert (first, cached) == (expected, 0)
        assert wait_for(lambda: published(cluster) > before)  # written back after the reply
        assert wait_for(lambda: sum(s.num_blocks for s in cluster.store_stats()) >= 62)
        if prompt is prompts[0]:
            # Round robin: the other prefill, whose pools never saw the prompt, takes the block
            # KV from the store and the window from the first prefill's SWA region.
            second, cached = complete(cluster, prompt)
            assert (second, cached) == (expected, l1)
            assert cluster.metric("prefill", "epd_swa_windows_total", event="pulled") == pulled + 1
        else:
            # The window outlives its TTL nowhere: the other prefill replays the last 46 tokens
            # before L1 from the block KV, and computes only from there.
            time.sleep(SWA_TTL_S + 0.5)
            missed = cluster.metric("prefill", "epd_swa_windows_total", event="missed")
            second, cached = complete(cluster, prompt)
            assert (second, cached) == (expected, replay_start)
            assert cluster.metric("prefill", "epd_swa_windows_total", event="missed") == missed + 1


def test_the_next_turn_hits_the_window_decode_published(cluster, hybrid_chat_dir):
    prompt = random_prompts(1, [300], vocab=49152, seed=43)[0]
    before = cluster.metric("decode", "epd_swa_windows_total", event="published")
    answer, _ = complete(cluster, prompt, max_tokens=40)
    assert wait_for(lambda: cluster.metric("decode", "epd_swa_windows_total", event="published") > before)
    num_with_kv = len(prompt) + len(answer) - 1  # the last token has no KV yet
    next_turn = prompt + answer + random_prompts(1, [20], vocab=49152, seed=44)[0]
    tokens, cached = complete(cluster, next_turn, max_tokens=8)
    assert cached == num_with_kv // BLOCK * BLOCK  # the blocks decode wrote, and its window
    assert tokens == one_engine(hybrid_chat_dir, [next_turn], max_tokens=8)[0]


def test_a_killed_decode_resumes_from_the_store_token_identical(cluster):
    """The survivor pulls the context's block KV from the store and, its window gone with the
    dead instance, replays the last n_sliding * (W - 1) tokens before it: the same stream."""
    request = {"model": "hybrid-chat0", "stream": True, "temperature": 0, "max_tokens": 400, "ignore_eos": True,
               "messages": [{"role": "user", "content": "Tell a long story about a lighthouse."}]}
    wait_for_decodes(cluster)
    undisturbed = stream(cluster.url, request)
    killed = []

    def kill(num_chunks: int) -> None:
        child = serving_decode(cluster)
        os.kill(child.process.pid, signal.SIGSTOP)
        os.kill(child.process.pid, signal.SIGKILL)
        child.process.wait()
        killed.append(child.name)

    decodes = [c.name for c in cluster.cluster.children if c.name.startswith("decode")]
    disturbed = stream(cluster.url, request, after_tokens=kill)
    assert killed and disturbed == undisturbed
    assert cluster.metric("router", "epd_router_migrations_total", outcome="moved") >= 1
    survivor = next(name for name in decodes if name not in killed)
    assert cluster.metric(survivor, "epd_decode_resumed_tokens_total", source="cached") >= 64
    wait_for_decodes(cluster)


def test_a_window_whose_prefill_died_costs_only_the_replay(cluster, hybrid_chat_dir):
    """The store still names the window in the dead prefill's region: the other prefill's read
    of it fails (or finds the bytes intact), never hangs, and the output is one engine's."""
    prompt = random_prompts(1, [1000], vocab=49152, seed=45)[0]
    expected = one_engine(hybrid_chat_dir, [prompt])[0]
    names = ("prefill-0", "prefill-1")
    before = {name: cluster.metric(name, "epd_swa_windows_total", event="published") for name in names}
    first, cached = complete(cluster, prompt)
    assert (first, cached) == (expected, 0)
    assert wait_for(lambda: any(cluster.metric(n, "epd_swa_windows_total", event="published") > before[n]
                                for n in names))
    assert wait_for(lambda: sum(s.num_blocks for s in cluster.store_stats()) >= 62)
    publisher = next(c for c in cluster.cluster.children if c.name in names
                     and cluster.metric(c.name, "epd_swa_windows_total", event="published") > before[c.name])
    os.kill(publisher.process.pid, signal.SIGKILL)
    publisher.process.wait()
    second, cached = complete(cluster, prompt)
    assert second == expected and cached in (992, 944)  # the window read, or the replay
    assert wait_for(lambda: prefills_serving(cluster) == 2, timeout_s=60)  # the supervisor restarted it


def prefills_serving(cluster) -> int:
    try:
        return sum(r.role == "prefill" for r in cluster.loads())
    except grpc.RpcError:  # alive, not serving yet
        return 0
