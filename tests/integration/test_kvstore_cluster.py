"""Prefix hits through the KV store in a real cluster (2 prefill, 1 decode, 1 store node):
cross-instance hits with identical output, the next turn hitting prompt and answer, tenants
that never share blocks, and nothing left held afterwards."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.cluster import running_cluster
from tests.factories import random_prompts

BLOCK = 16
CHUNK = 64


@pytest.fixture(scope="module")
def cluster(tiny_chat_model_dir):
    with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=2, decodes=1, kv_cache_gib=0.05,
                         max_num_batched_tokens=CHUNK, device="cpu", kvstores=1,
                         prefill_policy="round_robin") as running:
        yield running


@pytest.fixture(autouse=True)
def nothing_held_after_each_test(cluster):
    yield
    assert cluster.leftovers() == []


def complete(cluster, prompt: list[int], **fields) -> tuple[list[int], int]:
    """(generated token ids, usage.prompt_tokens_details.cached_tokens) of one completion."""
    body = {"model": "tiny-chat0", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **fields}
    reply = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    return data["choices"][0]["token_ids"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_stored(cluster, num_blocks: int, timeout_s: float = 30.0) -> int:
    """Write-back runs after the reply: wait until the store holds ``num_blocks`` blocks."""
    deadline = time.monotonic() + timeout_s
    while (held := sum(s.num_blocks for s in cluster.store_stats())) < num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    return held


def per_prefill(cluster, name: str) -> dict[str, float]:
    return {p: cluster.metric(p, name) for p in ("prefill-0", "prefill-1")}


def test_a_prefix_written_by_one_prefill_is_hit_by_the_other(cluster):
    prompt = random_prompts(1, [1000], vocab=49152, seed=11)[0]
    puts, hits = per_prefill(cluster, "epd_kv_store_put_blocks_total"), per_prefill(cluster, "epd_kv_store_hit_blocks_total")
    held = sum(s.num_blocks for s in cluster.store_stats())
    first, cached_first = complete(cluster, prompt)
    assert cached_first == 0
    assert wait_stored(cluster, held + len(prompt) // BLOCK) >= held + len(prompt) // BLOCK
    second, cached_second = complete(cluster, prompt)
    assert second == first
    margin = 1  # a plain model computes at least the last prompt token
    assert cached_second >= len(prompt) - margin - BLOCK
    new_puts = {p: v - puts[p] for p, v in per_prefill(cluster, "epd_kv_store_put_blocks_total").items()}
    new_hits = {p: v - hits[p] for p, v in per_prefill(cluster, "epd_kv_store_hit_blocks_total").items()}
    writer = max(new_puts, key=new_puts.get)
    reader = max(new_hits, key=new_hits.get)
    assert new_puts[writer] == len(prompt) // BLOCK and new_hits[reader] == cached_second // BLOCK
    assert writer != reader  # round robin: the hit came from the other instance's work
    assert cluster.metric("kvstore", "epd_kvstore_hit_blocks_total") >= cached_second // BLOCK
    assert cluster.metric("kvstore", "epd_kvstore_blocks", tier="node") >= len(prompt) // BLOCK


def test_the_next_turn_hits_the_prompt_and_the_answer(cluster):
    prompt = random_prompts(1, [300], vocab=49152, seed=12)[0]
    held = sum(s.num_blocks for s in cluster.store_stats())
    answer, _ = complete(cluster, prompt, max_tokens=40)
    # Decode writes prompt + answer (all but the last token have KV) once it finishes.
    num_with_kv = len(prompt) + len(answer) - 1
    assert wait_stored(cluster, held + num_with_kv // BLOCK) >= held + num_with_kv // BLOCK
    next_turn = prompt + answer + random_prompts(1, [20], vocab=49152, seed=13)[0]
    _, cached = complete(cluster, next_turn, max_tokens=4)
    assert cached == min(num_with_kv // BLOCK, (len(next_turn) - 1) // BLOCK) * BLOCK


def test_two_tenants_with_the_same_prompt_never_share_blocks(cluster):
    prompt = random_prompts(1, [400], vocab=49152, seed=14)[0]
    held = sum(s.num_blocks for s in cluster.store_stats())
    first_a, cached = complete(cluster, prompt, cache_salt="tenant-a")
    assert cached == 0
    assert wait_stored(cluster, held + len(prompt) // BLOCK) >= held + len(prompt) // BLOCK
    first_b, cached_b = complete(cluster, prompt, cache_salt="tenant-b")
    assert cached_b == 0 and first_b == first_a  # same tokens, no shared KV
    unsalted, cached_none = complete(cluster, prompt)
    assert cached_none == 0 and unsalted == first_a
    # Three copies of the same prompt's blocks, one per salt.
    assert wait_stored(cluster, held + 3 * (len(prompt) // BLOCK)) >= held + 3 * (len(prompt) // BLOCK)
    again_a, cached_a = complete(cluster, prompt, cache_salt="tenant-a")
    assert again_a == first_a and cached_a >= len(prompt) - 1 - BLOCK
    bad = httpx.post(cluster.url + "/v1/completions", json={"model": "tiny-chat0", "prompt": prompt,
                                                             "cache_salt": ""}, timeout=30)
    assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]
