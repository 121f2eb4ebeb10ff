"""The simulator's KV store (sim/hits.py): the plain rule unchanged, a hybrid model's SWA windows."""

from __future__ import annotations

import pytest

from kvstore.hit_rule import ModelKVShape
from services.common.cost_model import DecodeCost, PrefillCost
from services.router.sim.__main__ import main
from services.router.sim.cluster import SimConfig, simulate
from services.router.sim.hits import PrefixHits
from services.router.sim.trace import SimClock, TraceRequest
from services.router.sim.work import Costs

HYBRID = ModelKVShape(sliding_window=128, replay_tokens=700)
COSTS = Costs(prefill=PrefillCost(a=0.0, b=1e-3, d=0.0), decode=DecodeCost(a=0.01, b=0.0, c=0.0), step_budget_s=1e6)


def req(i: int, num_in: int, hash_ids: tuple[int, ...], at_s: float = 0.0) -> TraceRequest:
    return TraceRequest(f"r{i}", at_s, num_in, 1, hash_ids)


def make(shape: ModelKVShape = ModelKVShape(), **kwargs) -> tuple[PrefixHits, SimClock]:
    clock = SimClock()
    return PrefixHits(1024, clock, shape, **kwargs), clock


def serve(hits: PrefixHits, request: TraceRequest) -> tuple[int, int]:
    """Look up, then store what the prefill computed (as a prefill does)."""
    found = hits.lookup(request)
    hits.store(request, found[0])
    return found


def test_plain_model_keeps_the_trace_rule():
    hits, _ = make()
    assert serve(hits, req(0, 1200, (1, 2, 3))) == (0, 0)
    assert hits.lookup(req(1, 1200, (1, 2, 3))) == (3, 1199)   # the partial last block counts, less 1
    assert hits.lookup(req(2, 1536, (1, 2, 3))) == (3, 1535)
    assert hits.lookup(req(3, 5000, (1, 2, 9))) == (2, 1024)
    assert hits.swa is None
    counts = hits.counts
    assert (counts.num_lookups, counts.num_window_asks, counts.swa_hit_rate) == (4, 0, None)
    assert (counts.num_hit_tokens, counts.num_block_tokens) == (1199 + 1535 + 1024, 1199 + 1535 + 1024)


def test_plain_simulation_counts_one_lookup_per_request():
    requests = [req(0, 1536, (1, 2, 3)), req(1, 1536, (1, 2, 3), at_s=10.0)]
    result = simulate(requests, SimConfig(1, 1, COSTS), "round_robin")
    assert [r.num_cached for r in result.records] == [0, 1535]
    assert (result.hits.num_lookups, result.hits.num_hit_tokens, result.hits.num_window_asks) == (2, 1535, 0)


def test_a_repeat_within_the_ttl_hits_l1():
    hits, clock = make(HYBRID, swa_ttl_s=180.0)
    assert serve(hits, req(0, 2000, (1, 2, 3, 4))) == (0, 0)
    clock.now = 179.0
    # L1 = min(4 * 512, 2000 - 1) rounded down to a block = 1536: the window (3, 1536) is live.
    assert hits.lookup(req(1, 2000, (1, 2, 3, 4))) == (4, 1536)
    counts = hits.counts
    assert (counts.num_window_asks, counts.num_window_hits, counts.swa_hit_rate) == (1, 1, 1.0)
    assert (counts.num_block_tokens, counts.num_hit_tokens) == (1536, 1536)


def test_after_the_ttl_a_hit_replays():
    hits, clock = make(HYBRID, swa_ttl_s=180.0)
    serve(hits, req(0, 2000, (1, 2, 3, 4)))
    clock.now = 180.0
    # No window: 1536 - 700 = 836, rounded down to a block: 512.
    assert hits.lookup(req(1, 2000, (1, 2, 3, 4))) == (4, 512)
    assert (hits.counts.num_window_asks, hits.counts.num_window_hits, hits.counts.swa_hit_rate) == (1, 0, 0.0)
    assert (hits.counts.num_block_tokens, hits.counts.num_hit_tokens) == (1536, 512)


def test_a_hit_renews_its_window():
    hits, clock = make(HYBRID, swa_ttl_s=180.0)
    serve(hits, req(0, 2000, (1, 2, 3, 4)))
    clock.now = 100.0
    assert hits.lookup(req(1, 2000, (1, 2, 3, 4))) == (4, 1536)
    clock.now = 250.0
    assert hits.lookup(req(2, 2000, (1, 2, 3, 4))) == (4, 1536)


def test_no_block_hit_never_asks_for_a_window():
    hits, _ = make(HYBRID)
    serve(hits, req(0, 2000, (1, 2, 3, 4)))
    assert hits.lookup(req(1, 2000, (7, 8, 9, 10))) == (0, 0)
    # L1 = 512 asks for the window (1, 512): none yet, and 512 - 700 replays it all. Then published.
    assert serve(hits, req(2, 600, (1, 11))) == (1, 0)
    # One block hit, but L1 = min(512, 512 - 1) rounded down = 0: nothing to take a window for.
    assert hits.lookup(req(3, 512, (1,))) == (1, 0)
    assert (hits.counts.num_lookups, hits.counts.num_window_asks, hits.counts.num_window_hits) == (4, 1, 0)


def test_a_shared_prefix_ending_where_no_prompt_ended_replays():
    hits, _ = make(HYBRID)
    serve(hits, req(0, 3000, (1, 2, 3, 4, 5, 6)))     # publishes (5, 2560)
    # Shares 3 blocks: L1 = 1536, but no prefill ended its prompt there, so no window: 836 -> 512.
    assert hits.lookup(req(1, 3000, (1, 2, 3, 7, 8, 9))) == (3, 512)
    assert (hits.counts.num_window_asks, hits.counts.num_window_hits) == (1, 0)


def test_uncounted_lookups_leave_the_tally():
    hits, _ = make(HYBRID)
    serve(hits, req(0, 2000, (1, 2, 3, 4)))
    assert hits.lookup(req(1, 2000, (1, 2, 3, 4)), is_counted=False) == (4, 1536)
    assert (hits.counts.num_lookups, hits.counts.num_window_asks) == (1, 0)


def test_the_swa_pool_holds_at_most_its_capacity():
    hits, clock = make(HYBRID, swa_capacity_entries=2)
    for i in range(3):
        clock.now = float(i)
        serve(hits, req(i, 2000, (10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4)))
    assert hits.swa is not None and len(hits.swa) == 2
    assert hits.lookup(req(3, 2000, (1, 2, 3, 4))) == (4, 512)       # the oldest window went first
    assert hits.lookup(req(4, 2000, (21, 22, 23, 24))) == (4, 1536)


@pytest.mark.parametrize("swa_ttl_s, num_cached", [(180.0, 1536), (5.0, 512)])
def test_simulated_hybrid_prefill_takes_the_window_while_live(swa_ttl_s, num_cached):
    # r0 computes 2000 tokens in 2 s and publishes its window; r1 comes at 10 s.
    config = SimConfig(1, 1, COSTS, kv_shape=HYBRID, swa_ttl_s=swa_ttl_s)
    requests = [req(0, 2000, (1, 2, 3, 4)), req(1, 2000, (1, 2, 3, 4), at_s=10.0)]
    result = simulate(requests, config, "round_robin")
    assert [r.num_cached for r in result.records] == [0, num_cached]
    assert result.records[1].first_token_s == pytest.approx(10.0 + (2000 - num_cached) * 1e-3)
    assert (result.hits.num_lookups, result.hits.num_window_asks) == (2, 1)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="swa_ttl_s"):
        SimConfig(1, 1, swa_ttl_s=0.0)
    assert main(["--limit", "1", "--replay-tokens", "100"]) == 2        # a replay needs a window
    assert main(["--limit", "1", "--sliding-window", "0"]) == 2
