"""Prefix hits of a real trace through the KV store's own index, TTL and eviction code (no model).

Replays ``hash_ids`` of the Mooncake trace (chained ids of 512-token blocks) in timestamp order
on the trace's own clock: each request looks up its longest live cached prefix (which renews
those blocks), then stores all its blocks with the chat TTL. The achieved hit rate (hit blocks /
all blocks) is compared with the ideal of an infinite cache that never forgets, on the same
trace. A capacity of at least the trace's distinct blocks never evicts, so there the hit rate
equals the ideal by construction (a warning says so); the hit rate is therefore also reported
at 25 / 50 / 75 % of the distinct-block count, where eviction decides. Then the smallest
capacity that still reaches --goal of the ideal is searched for.

Then a hybrid model like the reference's (sliding window 128, replay 20 * 127 = 2540 tokens;
SPEC.md, "Hybrid models and bounded replay") through the simulator's own KV store
(``services/router/sim/hits.py``: block index, SWA tier, ``kvstore/hit_rule.py``), at
--capacity-blocks and each --swa-ttls: a prefill publishes the window ending at its own L1, a
later one whose block hit reaches L1 > 0 takes the window ending there if it is live, else
replays. SPEC says the reference still hits >= 98% with a 180 s SWA TTL.

Last line: JSON with hit_rate, ideal_hit_rate, hit_vs_ideal, capacity_blocks (the --capacity-blocks
the hit rate was measured at, default the index's default), capacity_holds_every_block (true:
hit_vs_ideal is 1 by construction), by_capacity (hit_rate and hit_vs_ideal at each fraction of
the distinct blocks, and at --capacity-blocks), min_capacity_blocks (the smallest reaching the goal);
and at the 180 s SWA TTL: swa_hit_rate (of the lookups whose block hit L1 > 0, the share whose
window was live), swa_token_hit_rate (prompt tokens skipped, windows or replay, over all prompt
tokens) vs swa_block_hit_rate (L1 over all prompt tokens: every window live), their ratio
swa_token_vs_block, and swa (the shape, the plain model's token hit rate, those figures at every TTL).

    python benchmarks/trace_hits.py [--trace PATH] [--capacity-blocks N] [--goal 0.97]
        [--sliding-window 128] [--replay-tokens 2540] [--swa-ttls 30,180,600]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.hit_rule import ModelKVShape  # noqa: E402
from kvstore.index import DEFAULT_CAPACITY_BLOCKS, EmbeddedIndex  # noqa: E402
from kvstore.retention import Retention  # noqa: E402
from kvstore.swa import DEFAULT_SWA_TTL_S  # noqa: E402
from services.router.sim.hits import DEFAULT_SWA_CAPACITY_ENTRIES, HitCounts, PrefixHits  # noqa: E402
from services.router.sim.trace import SimClock, TraceRequest, load_trace  # noqa: E402

FRACTIONS = (0.25, 0.5, 0.75)  # of the distinct blocks: capacities where eviction decides
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


class TraceClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def load(path: Path) -> list[tuple[float, list[int]]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((row["timestamp"] / 1000.0, row["hash_ids"]) for row in rows)


def ideal_hit_rate(requests: list[tuple[float, list[int]]]) -> float:
    seen: set[int] = set()
    num_hits = num_blocks = 0
    for _, hashes in requests:
        for block in hashes:
            if block not in seen:
                break
            num_hits += 1
        seen.update(hashes)
        num_blocks += len(hashes)
    return num_hits / num_blocks


def replay(requests: list[tuple[float, list[int]]], capacity_blocks: int) -> float:
    clock = TraceClock()
    index = EmbeddedIndex(capacity_blocks, clock)
    ttl_s = Retention().ttl_s("chat")
    num_hits = num_blocks = 0
    for timestamp_s, hashes in requests:
        clock.now = timestamp_s
        num_hits += index.lookup(hashes)
        num_blocks += len(hashes)
        for block in hashes:
            index.insert(block, ttl_s)
    return num_hits / num_blocks


def replay_hits(requests: list[TraceRequest], capacity_blocks: int, shape: ModelKVShape,
                swa_ttl_s: float = DEFAULT_SWA_TTL_S,
                swa_capacity_entries: int = DEFAULT_SWA_CAPACITY_ENTRIES) -> HitCounts:
    """Each request looks its prefix up and stores what it computed at its arrival (the trace's
    clock, no compute time), through the simulator's KV store."""
    clock = SimClock()
    hits = PrefixHits(capacity_blocks, clock, shape, swa_ttl_s, swa_capacity_entries)
    for request in requests:
        clock.now = request.arrival_s
        num_hit_blocks, _ = hits.lookup(request)
        hits.store(request, num_hit_blocks)
    return hits.counts


def swa_figures(requests: list[TraceRequest], capacity_blocks: int, shape: ModelKVShape, ttls_s: list[float],
                swa_capacity_entries: int) -> dict:
    plain = replay_hits(requests, capacity_blocks, ModelKVShape())
    by_ttl = []
    for ttl_s in ttls_s:
        counts = replay_hits(requests, capacity_blocks, shape, ttl_s, swa_capacity_entries)
        swa_hit_rate = counts.swa_hit_rate
        by_ttl.append({"swa_ttl_s": ttl_s, "swa_hit_rate": None if swa_hit_rate is None else round(swa_hit_rate, 4),
                       "token_hit_rate": round(counts.hit_rate, 4), "block_hit_rate": round(counts.block_hit_rate, 4),
                       "token_vs_block": round(counts.num_hit_tokens / max(1, counts.num_block_tokens), 4),
                       "num_window_asks": counts.num_window_asks, "num_window_hits": counts.num_window_hits})
    return {"sliding_window": shape.sliding_window, "replay_tokens": shape.replay_tokens,
            "swa_capacity_entries": swa_capacity_entries, "plain_token_hit_rate": round(plain.hit_rate, 4),
            "by_ttl": by_ttl}


def min_capacity(requests: list[tuple[float, list[int]]], target: float, upper: int) -> int:
    """Smallest capacity whose hit rate reaches ``target`` (hit rate grows with capacity under LRU)."""
    lo, hi = 1, upper
    while lo < hi:
        mid = (lo + hi) // 2
        if replay(requests, mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--capacity-blocks", type=int, default=DEFAULT_CAPACITY_BLOCKS)
    parser.add_argument("--goal", type=float, default=0.97)
    parser.add_argument("--sliding-window", type=int, default=128, help="the hybrid model's window (tokens)")
    parser.add_argument("--replay-tokens", type=int, default=20 * 127,
                        help="tokens a hit without its window recomputes (n_sliding * (W - 1))")
    parser.add_argument("--swa-ttls", default="30,180,600", help="SWA TTLs in seconds, comma-separated")
    parser.add_argument("--swa-capacity-entries", type=int, default=DEFAULT_SWA_CAPACITY_ENTRIES)
    args = parser.parse_args()
    ttls_s = sorted({float(t) for t in args.swa_ttls.split(",") if t.strip()} | {DEFAULT_SWA_TTL_S})
    requests = load(args.trace)
    ideal = ideal_hit_rate(requests)
    num_unique = len({block for _, hashes in requests for block in hashes})
    capacities = [max(1, round(fraction * num_unique)) for fraction in FRACTIONS] + [args.capacity_blocks]
    by_capacity = []
    for capacity in capacities:
        achieved = replay(requests, capacity)
        by_capacity.append({"capacity_blocks": capacity, "fraction_of_distinct": round(capacity / num_unique, 4),
                            "hit_rate": round(achieved, 4), "hit_vs_ideal": round(achieved / ideal, 4)})
    needed = min_capacity(requests, args.goal * ideal, max(args.capacity_blocks, num_unique))
    span_s = requests[-1][0] - requests[0][0]
    print(f"{len(requests)} requests over {span_s:.0f} s, {num_unique} distinct blocks; chat TTL "
          f"{Retention().chat_ttl_s / 86400:.0f} days (longer than the trace: capacity decides)")
    for point in by_capacity:
        print(f"capacity {point['capacity_blocks']:>6} blocks ({point['fraction_of_distinct']:.2f}x the distinct "
              f"blocks): hit rate {point['hit_rate']:.4f} vs ideal {ideal:.4f} ({point['hit_vs_ideal']:.3f})")
    print(f"{args.goal:.0%} of ideal needs {needed} blocks ({needed / num_unique:.2f}x the distinct blocks)")
    holds_all = args.capacity_blocks >= num_unique
    if holds_all:
        sys.stdout.flush()  # the warning lands after the figures it qualifies
        print(f"WARNING: capacity {args.capacity_blocks} >= the trace's {num_unique} distinct blocks: nothing is "
              f"ever evicted, so its hit_vs_ideal is 1.0 by construction; read the smaller capacities",
              file=sys.stderr)
    swa = swa_figures(load_trace(args.trace), args.capacity_blocks,
                      ModelKVShape(args.sliding_window, args.replay_tokens), ttls_s, args.swa_capacity_entries)
    print(f"hybrid model (window {args.sliding_window}, replay {args.replay_tokens} tokens), capacity "
          f"{args.capacity_blocks} blocks; plain model's token hit rate {swa['plain_token_hit_rate']:.4f}")
    for point in swa["by_ttl"]:
        print(f"SWA TTL {point['swa_ttl_s']:>5.0f} s: window live for {point['swa_hit_rate']} of "
              f"{point['num_window_asks']} lookups with L1 > 0; token hit rate {point['token_hit_rate']:.4f} "
              f"vs block hit rate (L1) {point['block_hit_rate']:.4f} ({point['token_vs_block']:.3f})")
    at_default = next(p for p in swa["by_ttl"] if p["swa_ttl_s"] == DEFAULT_SWA_TTL_S)
    default = by_capacity[-1]
    print(json.dumps({"hit_rate": default["hit_rate"], "ideal_hit_rate": round(ideal, 4),
                      "hit_vs_ideal": default["hit_vs_ideal"], "capacity_blocks": args.capacity_blocks,
                      "capacity_holds_every_block": holds_all, "by_capacity": by_capacity,
                      "min_capacity_blocks": needed, "num_distinct_blocks": num_unique,
                      "swa_hit_rate": at_default["swa_hit_rate"], "swa_token_hit_rate": at_default["token_hit_rate"],
                      "swa_block_hit_rate": at_default["block_hit_rate"],
                      "swa_token_vs_block": at_default["token_vs_block"], "swa": swa}))


if __name__ == "__main__":
    main()
