"""The cluster with every KV move over one transport (``--kv-transport``): shared memory, TCP (as
between machines) and NIXL (where it is installed). 2 prefill + 2 decode + a store node: the
prefill -> decode hand-over and the KV store's reads and writes all go through that transport
(no other is loaded anywhere). Answers equal the offline engine's, every hand-over is a transfer,
prefix hits come from the store, and nothing stays held."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvstore.transfer.engine import TRANSPORT_CHOICES
from kvstore.transfer.memory import SHM_PREFIX

from services.engine import LLM, SamplingParams
from tests.cluster import running_cluster
from tests.factories import random_prompts
from tests.integration.test_cluster import completions
from tests.integration.test_kvstore_cluster import BLOCK, complete, wait_stored

LENGTHS = [5, 300, 64, 700, 17, 150]


TRANSPORTS = [t for t in ("shm", "tcp", "nixl") if t in TRANSPORT_CHOICES]


@pytest.fixture(scope="module", params=TRANSPORTS)
def cluster(request, tiny_chat_model_dir):
    with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=2, decodes=2, kvstores=1,
                         kv_cache_gib=0.05, max_num_batched_tokens=64, device="cpu",
                         prefill_policy="round_robin", kv_transport=request.param) as running:
        yield running


def test_the_hand_over_over_each_transport_equals_the_offline_engine(cluster, tiny_chat_model_dir):
    prompts = random_prompts(len(LENGTHS), LENGTHS, vocab=49152, seed=41)
    expected = [o.token_ids for o in LLM(str(tiny_chat_model_dir), num_kv_blocks=1024).generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    transferred = cluster.metric("decode", "epd_kv_transfers_total", result="done")
    got = asyncio.run(completions(cluster.url, prompts, temperature=0, max_tokens=12, ignore_eos=True))
    assert got == expected
    # Every prompt that decode did not finish at once came over: none was recomputed.
    assert cluster.metric("decode", "epd_kv_transfers_total", result="done") - transferred == len(prompts)
    assert cluster.metric("decode", "epd_kv_transfers_total", result="failed") == 0
    forced = cluster.cluster.config.kv_transport
    for transport in ("shm", "tcp", "nixl"):  # the metric names the transport that moved the bytes
        moved = cluster.metric("decode", "epd_kv_transfer_bytes_total", transport=transport)
        assert (moved > 0) == (transport == forced), (transport, moved)
    assert_mapped_only_over_shm(cluster)
    assert cluster.leftovers() == []


def test_store_writes_and_hits_over_each_transport(cluster):
    prompt = random_prompts(1, [640], vocab=49152, seed=42)[0]
    held = sum(s.num_blocks for s in cluster.store_stats())
    first, cached = complete(cluster, prompt)
    assert cached == 0
    assert wait_stored(cluster, held + len(prompt) // BLOCK) >= held + len(prompt) // BLOCK   # the store node read the blocks through it
    hits = cluster.metric("prefill", "epd_kv_store_hit_blocks_total")
    again, cached = complete(cluster, prompt)          # the other prefill: its hits come from the store
    assert again == first and cached >= len(prompt) - 1 - BLOCK
    assert cluster.metric("prefill", "epd_kv_store_hit_blocks_total") >= hits + cached // BLOCK
    assert_mapped_only_over_shm(cluster)
    assert cluster.leftovers() == []


def assert_mapped_only_over_shm(cluster) -> None:
    """Shared memory reads a peer by mapping its pool; TCP and NIXL (CMA on one host) never do."""
    mapped = mapped_pools_of_others(cluster)
    if cluster.cluster.config.kv_transport == "shm":
        assert "decode-0" in mapped or "decode-1" in mapped, mapped
    else:
        assert mapped == {}


def mapped_pools_of_others(cluster) -> dict[str, list[str]]:
    """Per process, the KV pools of other processes it has mapped: the shared-memory transport
    maps the owner's /dev/shm file to read it; over TCP or NIXL nobody maps anyone else's."""
    found = {}
    for child in cluster.cluster.children:
        own = f"{SHM_PREFIX}{child.process.pid}-"
        maps = Path(f"/proc/{child.process.pid}/maps").read_text().splitlines()
        others = sorted({line.split()[-1] for line in maps if SHM_PREFIX in line and own not in line})
        if others:
            found[child.name] = others
    return found
