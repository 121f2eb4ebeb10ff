"""`epd up --kvstores 2 --redis URL --kvstore-replicas 2`: two store nodes sharing a real Redis;
a prefix written through the cluster is still hit after one node is killed."""

from __future__ import annotations

import redis

from tests.cluster import running_cluster
from tests.factories import random_prompts
from tests.integration.test_kvstore_cluster import BLOCK, complete, wait_stored


def test_two_replicas_on_redis_survive_the_loss_of_a_node(tiny_chat_model_dir, redis_url):
    prompt = random_prompts(1, [640], vocab=49152, seed=31)[0]
    with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=2, decodes=1, kv_cache_gib=0.05,
                         max_num_batched_tokens=64, device="cpu", kvstores=2, redis=redis_url,
                         kvstore_replicas=2, prefill_policy="round_robin") as cluster:
        try:
            first, cached = complete(cluster, prompt)
            assert cached == 0
            # Every block on both nodes: the two node indexes (in Redis) hold twice the blocks.
            assert wait_stored(cluster, 2 * (len(prompt) // BLOCK)) >= 2 * (len(prompt) // BLOCK)
            assert [s.num_blocks >= len(prompt) // BLOCK for s in cluster.store_stats()] == [True, True]
            victim = next(c for c in cluster.cluster.children if c.name == "kvstore-0")
            victim.process.kill()
            victim.process.wait()
            hits_before = cluster.metric("prefill", "epd_kv_store_hit_blocks_total")
            second, cached = complete(cluster, prompt)  # the other prefill: its hits come from kvstore-1
            assert second == first and cached >= len(prompt) - 1 - BLOCK
            # ... read from the store, not from the first prefill's own prefix cache.
            assert cluster.metric("prefill", "epd_kv_store_hit_blocks_total") >= hits_before + cached // BLOCK
            assert cluster.leftovers() == []
        finally:
            redis.Redis.from_url(redis_url).flushdb()
