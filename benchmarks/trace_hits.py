"""Prefix hits of a real trace through the KV store's own index, TTL and eviction code (no model).

Replays ``hash_ids`` of the Mooncake trace (chained ids of 512-token blocks) in timestamp order
on the trace's own clock: each request looks up its longest live cached prefix (which renews
those blocks), then stores all its blocks with the chat TTL. The achieved hit rate (hit blocks /
all blocks) is compared with the ideal of an infinite cache that never forgets, on the same
trace. Then the smallest capacity that still reaches --goal of the ideal is searched for.
Last line: JSON with hit_rate, ideal_hit_rate, hit_vs_ideal, capacity_blocks (the default
capacity the hit rate was measured at), min_capacity_blocks (the smallest reaching the goal).

    python benchmarks/trace_hits.py [--trace PATH] [--capacity-blocks N] [--goal 0.97]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.index import DEFAULT_CAPACITY_BLOCKS, EmbeddedIndex  # noqa: E402
from kvstore.retention import Retention  # noqa: E402

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
    args = parser.parse_args()
    requests = load(args.trace)
    ideal = ideal_hit_rate(requests)
    achieved = replay(requests, args.capacity_blocks)
    num_unique = len({block for _, hashes in requests for block in hashes})
    needed = min_capacity(requests, args.goal * ideal, max(args.capacity_blocks, num_unique))
    span_s = requests[-1][0] - requests[0][0]
    print(f"{len(requests)} requests over {span_s:.0f} s, {num_unique} distinct blocks; chat TTL "
          f"{Retention().chat_ttl_s / 86400:.0f} days (longer than the trace: capacity decides)")
    print(f"capacity {args.capacity_blocks} blocks: hit rate {achieved:.4f} vs ideal {ideal:.4f} "
          f"({achieved / ideal:.3f}); {args.goal:.0%} of ideal needs {needed} blocks")
    print(json.dumps({"hit_rate": round(achieved, 4), "ideal_hit_rate": round(ideal, 4),
                      "hit_vs_ideal": round(achieved / ideal, 4), "capacity_blocks": args.capacity_blocks,
                      "min_capacity_blocks": needed, "num_distinct_blocks": num_unique}))


if __name__ == "__main__":
    main()
