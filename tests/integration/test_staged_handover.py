"""The cluster with every engine pool behind the host staging path (``EPD_PREFILL_KV_STAGING=on``,
``EPD_DECODE_KV_STAGING=on``: on the CPU the pool is then a plain tensor the transfer engine never
sees, as a CUDA pool is): hand-overs copy pool -> staging, are read staging -> staging and copied
into decode's pool; store writes and reads go through staging too. Answers equal the offline
engine's, every hand-over is counted as staged, store hits still arrive, nothing stays held."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from services.engine import LLM, SamplingParams
from tests.cluster import running_cluster
from tests.factories import random_prompts
from tests.integration.test_cluster import completions
from tests.integration.test_kvstore_cluster import BLOCK, complete, wait_stored

LENGTHS = [5, 300, 64, 700, 17, 150]
STAGED = {"EPD_PREFILL_KV_STAGING": "on", "EPD_DECODE_KV_STAGING": "on",
          "EPD_PREFILL_KV_STAGING_MIB": "16", "EPD_DECODE_KV_STAGING_MIB": "16"}


@pytest.fixture(scope="module")
def cluster(tiny_chat_model_dir):
    saved = {name: os.environ.get(name) for name in STAGED}
    os.environ.update(STAGED)  # the launcher's children inherit the environment
    try:
        # Two prefills taking turns, so the second sight of a prompt hits the store, not the
        # first prefill's own prefix cache.
        with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=2, decodes=1, kvstores=1,
                             kv_cache_gib=0.05, max_num_batched_tokens=64, device="cpu",
                             prefill_policy="round_robin") as running:
            yield running
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def paths(cluster, role: str) -> dict[str, float]:
    return {path: cluster.metric(role, "epd_kv_handover_path_total", path=path)
            for path in ("direct", "staged", "recompute")}


def test_a_staged_hand_over_equals_the_offline_engine(cluster, tiny_chat_model_dir):
    prompts = random_prompts(len(LENGTHS), LENGTHS, vocab=49152, seed=41)
    expected = [o.token_ids for o in LLM(str(tiny_chat_model_dir), num_kv_blocks=1024).generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    before = {role: paths(cluster, role) for role in ("prefill", "decode")}
    got = asyncio.run(completions(cluster.url, prompts, temperature=0, max_tokens=12, ignore_eos=True))
    assert got == expected
    for role in ("prefill", "decode"):  # every hand-over went through staging on both sides
        after = paths(cluster, role)
        assert {p: after[p] - before[role][p] for p in after} == {"direct": 0, "staged": len(prompts),
                                                                   "recompute": 0}, role
    assert cluster.metric("decode", "epd_kv_transfers_total", result="failed") == 0
    assert cluster.leftovers() == []
    assert staging_in_use(cluster) == 0


def test_store_writes_and_hits_through_staging(cluster):
    prompt = random_prompts(1, [640], vocab=49152, seed=42)[0]
    held = sum(s.num_blocks for s in cluster.store_stats())
    first, cached = complete(cluster, prompt)
    assert cached == 0
    assert wait_stored(cluster, held + len(prompt) // BLOCK) >= held + len(prompt) // BLOCK  # the store read them from a staging region
    hits = cluster.metric("prefill", "epd_kv_store_hit_blocks_total")
    again, cached = complete(cluster, prompt)  # the other prefill: its hits come through staging
    assert again == first and cached >= len(prompt) - 1 - BLOCK
    assert cluster.metric("prefill", "epd_kv_store_hit_blocks_total") >= hits + cached // BLOCK
    assert cluster.metric("prefill", "epd_kv_staging_full_total") == 0
    assert cluster.leftovers() == []
    assert staging_in_use(cluster) == 0


def staging_in_use(cluster, timeout_s: float = 15.0) -> float:
    """Staging slots still held on any engine once the background writes have settled."""
    deadline = time.monotonic() + timeout_s
    while (in_use := sum(cluster.metric(role, "epd_kv_staging_slots_in_use") for role in ("prefill", "decode"))) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    return in_use
