"""A store node with a disk tier, restarted inside a running cluster: its disk hits survive, and
a block corrupted on disk fails its checksum, is recomputed, and the output stays identical."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from kvstore.hashing import block_hashes, root_hash
from services.common.server import wait_for_health
from tests.cluster import running_cluster
from tests.factories import random_prompts
from tests.integration.test_kvstore_cluster import BLOCK, complete, wait_stored


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvstore")


@pytest.fixture(scope="module")
def cluster(tiny_chat_model_dir, disk_dir):
    with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=2, decodes=1, kv_cache_gib=0.05,
                         max_num_batched_tokens=64, device="cpu", kvstores=1, kvstore_dir=str(disk_dir),
                         prefill_policy="round_robin") as running:
        yield running


def restart_store(cluster, change_disk=None) -> None:
    """SIGTERM the store node (it finishes its disk writes), optionally edit its files, start it again."""
    child = next(c for c in cluster.cluster.children if c.name == "kvstore-0")
    child.process.terminate()
    assert child.process.wait(timeout=30) == 0
    if change_disk is not None:
        change_disk()
    child.process = subprocess.Popen(child.process.args)
    assert asyncio.run(wait_for_health(child.address, "epd.v1.KVStore", timeout_s=60))


def test_a_restarted_store_keeps_its_disk_hits(cluster):
    # Round robin: the first request goes to one prefill, the second to the other, whose own
    # prefix cache never saw the prompt, so every hit comes from the store's disk tier.
    prompt = random_prompts(1, [640], vocab=49152, seed=21)[0]
    first, cached = complete(cluster, prompt)
    assert cached == 0
    assert wait_stored(cluster, len(prompt) // BLOCK) >= len(prompt) // BLOCK
    restart_store(cluster)
    stats = cluster.store_stats()[0]
    assert stats.num_blocks >= len(prompt) // BLOCK and stats.num_host_blocks == 0  # rebuilt from disk
    second, cached = complete(cluster, prompt)
    assert second == first and cached >= len(prompt) - 1 - BLOCK
    assert cluster.leftovers() == []


def test_a_corrupt_block_on_disk_is_recomputed_and_the_output_is_identical(cluster, disk_dir):
    prompt = random_prompts(1, [480], vocab=49152, seed=22)[0]
    held = cluster.store_stats()[0].num_blocks  # before the request: its write-back may beat the reply
    first, cached = complete(cluster, prompt)  # round robin again: written by one prefill ...
    assert cached == 0
    assert wait_stored(cluster, held + len(prompt) // BLOCK) >= held + len(prompt) // BLOCK
    root = root_hash(model="tiny-chat0", block_size=BLOCK, dtype="float32")
    victim = block_hashes(prompt, BLOCK, root)[10]

    def corrupt() -> None:
        for segment in disk_dir.rglob("segment-*"):
            raw = bytearray(segment.read_bytes())
            at = raw.find(victim)
            if at >= 0:
                raw[at + 200] ^= 0xFF  # inside the record's data, past its header
                segment.write_bytes(bytes(raw))
                return
        raise AssertionError("the block's record is not on disk")

    restart_store(cluster, corrupt)
    second, cached = complete(cluster, prompt)  # ... read by the other
    assert second == first
    assert cached == 10 * BLOCK  # the hit stops at the corrupt block; the rest was recomputed
    assert cluster.store_stats()[0].num_corrupt == 1
    assert cluster.leftovers() == []
