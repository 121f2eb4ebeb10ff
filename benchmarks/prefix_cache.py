"""Time to first token of a long prompt: prefix-cache miss vs. a full hit read from the KV store.

A real local cluster (the launcher's own code, as ``epd up`` runs it): 2 prefill instances, 1
decode, 1 KV store node (memory only), the router; SmolLM2-135M-Instruct, fp32 on the CPU. Each
repetition sends one fresh random prompt (--prompt-tokens token ids, /v1/completions, greedy,
``max_tokens`` 2, streamed) twice:

    miss: the prompt is new everywhere  --> prefill X computes all of it --> first token
          ... wait: write-back to the store (after the reply), decode done, cluster idle ...
    hit:  the same prompt again --> round robin: prefill Y, whose own prefix cache never saw
          it --> store lookup, acquire, one-sided read of the blocks --> computes the last
          block only --> first token

A hit must report ``cached_tokens`` >= prompt_tokens - 1 - 16 (a plain model computes at least
the last prompt token; hits are whole 16-token blocks) and a miss 0; anything else fails the
run. TTFT is measured at the client: from sending the HTTP request to the first SSE event that
carries generated text (completions streams have no role-only chunk; the router sends its
headers once it holds the first token, ``*_headers_s``). Repetitions are interleaved miss, hit,
miss, hit ... so load from other processes hits both alike, and a one-token filler request
after each pair swaps which prefill instance takes the miss and which the hit. One warm-up
pair per instance and role first (the first request of a process pays one-time costs), not
counted. Headline figures are medians; each repetition's ratio and the best runs are printed too.
Last line: JSON with miss_ttft_s, hit_ttft_s, hit_vs_miss (goal: hit_vs_miss <= 0.15).

    .venv/bin/python benchmarks/prefix_cache.py [--prompt-tokens 6000] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.launcher import Cluster, UpConfig, free_port  # noqa: E402
from services.pb import common_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc, prefill_pb2_grpc  # noqa: E402

GOAL = 0.15
BLOCK_SIZE = 16
"""Tokens per KV block (the engines' and the store's unit)."""
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4
"""SmolLM2-135M in fp32: 30 layers x (K, V) x 3 KV heads x 64 dims x 4 bytes = 46,080 bytes."""
HIT_METRIC = "epd_kv_store_hit_blocks_total"
MIN_TOKEN_ID = 100
"""Random prompts skip the low ids: SmolLM2 keeps its special tokens there."""
VOCAB_SIZE = 49152


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Reply:
    ttft_s: float
    """Request sent -> first SSE event carrying generated text."""
    headers_s: float
    """Request sent -> response headers (the router sends them once it has the first token)."""
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    text: str


class Client:
    """Streaming completions through the router, one keep-alive connection."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.http = httpx.Client(base_url=url, timeout=httpx.Timeout(900.0, connect=10.0))
        self.max_tokens = max_tokens

    def complete(self, prompt: list[int], max_tokens: int | None = None) -> Reply:
        body = {"prompt": prompt, "max_tokens": max_tokens or self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        ttft = usage = None
        text = []
        start = time.perf_counter()
        with self.http.stream("POST", "/v1/completions", json=body) as response:
            headers_s = time.perf_counter() - start
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()[:500]}")
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"the stream failed: {event['error']}")
                for choice in event.get("choices", ()):
                    if choice.get("text"):
                        if ttft is None:
                            ttft = time.perf_counter() - start
                        text.append(choice["text"])
                usage = event.get("usage") or usage
        total = time.perf_counter() - start
        if ttft is None or usage is None:
            raise RuntimeError(f"the stream had no text ({ttft=}) or no usage ({usage=})")
        return Reply(ttft, headers_s, total, usage["prompt_tokens"],
                     usage["prompt_tokens_details"]["cached_tokens"], "".join(text))

    def close(self) -> None:
        self.http.close()


class Probe:
    """What the benchmark reads off the running cluster between requests: store stats, loads,
    the per-instance store-hit counter."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def _live(self, role: str):
        return [c for c in self.cluster.children if c.name.startswith(role) and c.process.poll() is None]

    def store_blocks(self) -> tuple[int, int]:
        """(blocks held, leases open) over every store node."""
        num_blocks = num_leases = 0
        for child in self._live("kvstore"):
            with grpc.insecure_channel(child.address) as channel:
                stats = kvstore_pb2_grpc.KVStoreStub(channel).GetStats(kvstore_pb2.StoreStatsRequest(), timeout=5)
            num_blocks += stats.num_blocks
            num_leases += stats.num_leases
        return num_blocks, num_leases

    def busy(self) -> list[str]:
        """Engines with a request, lease or transfer in flight, or KV blocks out of the free pool."""
        held = []
        for role, stub_class in (("prefill", prefill_pb2_grpc.PrefillStub), ("decode", decode_pb2_grpc.DecodeStub)):
            for child in self._live(role):
                with grpc.insecure_channel(child.address) as channel:
                    r = stub_class(channel).GetLoad(common_pb2.LoadRequest(), timeout=5)
                if (r.num_running or r.num_waiting or r.num_leases or r.num_transfers_in_flight
                        or r.num_free_blocks != r.num_total_blocks):
                    held.append(child.name)
        return held

    def hit_blocks(self) -> dict[str, float]:
        """Blocks each prefill instance has read from the store so far."""
        counts = {}
        for child in self._live("prefill"):
            counts[child.name] = sum(
                sample.value for family in text_string_to_metric_families(httpx.get(child.metrics_url, timeout=5).text)
                for sample in family.samples if sample.name == HIT_METRIC)
        return counts

    def settle(self, min_blocks: int, timeout_s: float = 120.0) -> int:
        """Wait until the store holds ``min_blocks`` (write-back runs after the reply), every
        engine is idle, no store lease is open and the store's block count has stopped moving
        (decode writes prompt + answer once it finishes); the blocks held."""
        deadline = time.monotonic() + timeout_s
        last, stable_since = -1, time.monotonic()
        while time.monotonic() < deadline:
            num_blocks, num_leases = self.store_blocks()
            if num_blocks != last:
                last, stable_since = num_blocks, time.monotonic()
            if (num_blocks >= min_blocks and not num_leases and time.monotonic() - stable_since >= 0.5
                    and not self.busy()):
                time.sleep(0.5)  # let the cores go quiet (torch's worker threads spin a while)
                return num_blocks
            time.sleep(0.05)
        raise RuntimeError(f"the cluster did not settle in {timeout_s:.0f} s: store holds {last} blocks "
                           f"(want >= {min_blocks}), busy: {self.busy()}")


def random_prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(MIN_TOKEN_ID, VOCAB_SIZE) for _ in range(num_tokens)]


def min_hit_tokens(num_tokens: int) -> int:
    return num_tokens - 1 - BLOCK_SIZE


def changed(before: dict[str, float], after: dict[str, float]) -> list[str]:
    return [name for name in after if after[name] > before.get(name, 0.0)]


class Bench:
    def __init__(self, client: Client, probe: Probe, rng: random.Random) -> None:
        self.client = client
        self.probe = probe
        self.rng = rng
        self.held, _ = probe.store_blocks()

    def pair(self, num_tokens: int) -> tuple[Reply, Reply, str, str]:
        """(miss, hit, instance that missed, instance that hit) for one fresh prompt."""
        prompt = random_prompt(self.rng, num_tokens)
        self.held = self.probe.settle(self.held)
        hits_before = self.probe.hit_blocks()
        miss = self.client.complete(prompt)
        if miss.prompt_tokens != num_tokens or miss.cached_tokens != 0:
            raise RuntimeError(f"the miss was not a miss: {miss}")
        hits_mid = self.probe.hit_blocks()
        if changed(hits_before, hits_mid):
            raise RuntimeError(f"the miss read blocks from the store: {hits_before} -> {hits_mid}")
        self.held = self.probe.settle(self.held + num_tokens // BLOCK_SIZE)
        hit = self.client.complete(prompt)
        hits_after = self.probe.hit_blocks()
        if hit.cached_tokens < min_hit_tokens(num_tokens):
            raise RuntimeError(f"the hit was not a full hit: {hit.cached_tokens} cached of {hit.prompt_tokens} "
                               f"(want >= {min_hit_tokens(num_tokens)})")
        if hit.text != miss.text:
            raise RuntimeError(f"the hit answered differently: {hit.text!r} vs {miss.text!r}")
        readers = changed(hits_mid, hits_after)
        if len(readers) != 1:
            raise RuntimeError(f"expected one prefill instance to read the hit from the store: {hits_mid} -> {hits_after}")
        missed_on = next(name for name in hits_after if name != readers[0])
        return miss, hit, missed_on, readers[0]

    def filler(self) -> None:
        """A one-token request: moves the round robin on by one, so the next pair swaps roles."""
        self.held = self.probe.settle(self.held)
        self.client.complete(random_prompt(self.rng, BLOCK_SIZE * 2), max_tokens=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=3, help="measured miss/hit pairs (after the warm-up)")
    parser.add_argument("--warmup-tokens", type=int, default=1024, help="prompt length of the warm-up pairs")
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens generated per request")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="KV pool per engine; default: 2.5 prompts' worth, at least 0.25 GiB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a fast check: 1,500 tokens, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.prompt_tokens, args.repeats, args.warmup_tokens = 1500, 1, 256
    if args.prompt_tokens < 2 * BLOCK_SIZE or args.repeats < 1:
        parser.error("--prompt-tokens must be >= 32 and --repeats >= 1")
    warmup_tokens = min(args.warmup_tokens, args.prompt_tokens)
    prompt_bytes = args.prompt_tokens * KV_BYTES_PER_TOKEN
    kv_cache_gib = args.kv_cache_gib or max(0.25, round(2.5 * prompt_bytes / 2**30, 2))
    # Every distinct prompt stays in the store (no eviction during the run), plus headroom.
    num_stored_tokens = args.repeats * args.prompt_tokens + 2 * warmup_tokens + (args.repeats + 2) * 2 * BLOCK_SIZE
    capacity_mib = math.ceil(1.2 * num_stored_tokens * KV_BYTES_PER_TOKEN / 2**20) + 64
    config = UpConfig(model="", encoders=0, prefills=2, decodes=1, kvstores=1, kvstore_dir="none",
                      kvstore_capacity_mib=capacity_mib, kv_cache_gib=kv_cache_gib,
                      max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
                      port=free_port("127.0.0.1"), admin_port=free_port("127.0.0.1"),
                      # Round robin: the hit lands on the instance that did not compute the prompt,
                      # so the store serves it (a load-aware pick would reuse the idle writer's cache).
                      prefill_policy="round_robin")
    log(f"cluster: 2 prefill, 1 decode, 1 store node ({capacity_mib} MiB, memory only), "
        f"{kv_cache_gib} GiB KV per engine, chunk {args.max_num_batched_tokens} tokens, device {args.device}")

    # The children inherit our stdout: point it at stderr while they run, so that stdout
    # carries only the result.
    saved_stdout = os.dup(1)
    os.dup2(2, 1)
    cluster = Cluster(config)
    try:
        started = time.perf_counter()
        url = asyncio.run(cluster.start())
        log(f"cluster up in {time.perf_counter() - started:.1f} s at {url}")
        results = measure(Client(url, args.max_tokens), Probe(cluster), args, warmup_tokens)
    finally:
        cluster.stop()
        sys.stdout.flush()
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)
    report(results, args, kv_cache_gib, capacity_mib)


def measure(client: Client, probe: Probe, args: argparse.Namespace, warmup_tokens: int) -> dict:
    model = client.http.get("/v1/models").json()["data"][0]["id"]
    bench = Bench(client, probe, random.Random(args.seed))
    try:
        for k in range(2):  # each instance takes one warm-up miss and one warm-up hit
            miss, hit, missed_on, hit_on = bench.pair(warmup_tokens)
            log(f"warm-up {k}: {warmup_tokens} tokens, miss {miss.ttft_s:.3f} s on {missed_on}, "
                f"hit {hit.ttft_s:.3f} s on {hit_on} ({hit.cached_tokens} cached)")
            bench.filler()
        runs = []
        for k in range(args.repeats):
            miss, hit, missed_on, hit_on = bench.pair(args.prompt_tokens)
            runs.append((miss, hit, missed_on, hit_on))
            log(f"run {k}: miss {miss.ttft_s:.3f} s on {missed_on} (headers {miss.headers_s:.3f} s), "
                f"hit {hit.ttft_s:.3f} s on {hit_on} (headers {hit.headers_s:.3f} s, {hit.cached_tokens} of "
                f"{hit.prompt_tokens} cached): hit/miss {hit.ttft_s / miss.ttft_s:.3f}")
            if k + 1 < args.repeats:
                bench.filler()
        bench.probe.settle(bench.held)
    finally:
        client.close()
    return {"model": model, "runs": runs}


def report(results: dict, args: argparse.Namespace, kv_cache_gib: float, capacity_mib: int) -> None:
    runs = results["runs"]
    misses = [miss.ttft_s for miss, _, _, _ in runs]
    hits = [hit.ttft_s for _, hit, _, _ in runs]
    miss_s, hit_s = statistics.median(misses), statistics.median(hits)
    ratio = hit_s / miss_s
    log(f"{args.prompt_tokens}-token prompt, median of {len(runs)}: miss TTFT {miss_s:.3f} s, hit TTFT "
        f"{hit_s:.3f} s, hit/miss {ratio:.3f} (goal <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'})")
    print(json.dumps({
        "miss_ttft_s": round(miss_s, 4),
        "hit_ttft_s": round(hit_s, 4),
        "hit_vs_miss": round(ratio, 4),
        "goal_hit_vs_miss": GOAL,
        "meets_goal": ratio <= GOAL,
        "miss_ttft_runs_s": [round(t, 4) for t in misses],
        "hit_ttft_runs_s": [round(t, 4) for t in hits],
        "hit_vs_miss_runs": [round(h / m, 4) for m, h in zip(misses, hits)],
        "best_miss_ttft_s": round(min(misses), 4),
        "best_hit_ttft_s": round(min(hits), 4),
        "miss_headers_s": round(statistics.median(m.headers_s for m, _, _, _ in runs), 4),
        "hit_headers_s": round(statistics.median(h.headers_s for _, h, _, _ in runs), 4),
        "prompt_tokens": runs[0][0].prompt_tokens,
        "cached_tokens": min(hit.cached_tokens for _, hit, _, _ in runs),
        "miss_cached_tokens": max(miss.cached_tokens for miss, _, _, _ in runs),
        "miss_on": [m for _, _, m, _ in runs],
        "hit_on": [h for _, _, _, h in runs],
        "repeats": len(runs),
        "stat": f"median of {len(runs)} interleaved miss/hit pairs (after 2 warm-up pairs)",
        "max_tokens": args.max_tokens,
        "model": results["model"],
        "device": args.device,
        "kv_cache_gib": kv_cache_gib,
        "kvstore_capacity_mib": capacity_mib,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }))


if __name__ == "__main__":
    main()
