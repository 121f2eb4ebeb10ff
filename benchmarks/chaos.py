"""Chaos: a steady streaming load against ``epd up`` while its processes die, freeze and lose
Redis; every output compared token by token with an undisturbed run of the same requests.

The cluster is the launcher's own code, supervised as ``epd up`` supervises it: 2 prefill, 2
decode, 2 KV store nodes (every block on both), 1 encoder, the router, and a Redis that the store
nodes (their shared block index) and the router (keys and limits) use, started here.
SmolLM2-135M-Instruct unless ``--model``. The requests: streamed chat completions with prompts
and output caps from the Azure conversation trace (scaled to a 2-core CPU), greedy, seeded, and
JSON-schema constrained, ``--concurrency`` at a time. Two phases run the same requests:

    chaos:        while the fault schedule runs, one fault at a time, each after --gap-s of load:
                    kill -9 a decode (serving streams), kill -9 a prefill, kill -9 a store node,
                    kill -9 the encoder, SIGSTOP a decode for --freeze-s then SIGCONT, stop Redis
                    for --redis-down-s then start it again on its port;
                  after each, the cluster is watched until it is whole again (recovery)
    undisturbed:  the same requests again, no fault (the baseline)

Each phase has its own cache salt, so neither phase's prefix hits come from the other's
requests (their prompts are computed the same way); within the chaos phase a request that
loses its decode instance resumes elsewhere from the blocks its decode wrote to the store.

Figures (the last line, JSON):
- requests / failed: requests of the chaos phase, and those that did not complete (an HTTP
  error, an error event in the stream, or a stream without a finish reason);
- tokens_lost / tokens_repeated / mismatched_outputs: per request, its chaos tokens C against
  its undisturbed tokens U: mismatched when C != U; lost = |U| - matched, repeated = |C| -
  matched, matched being the tokens of the longest matching blocks (difflib);
- leaked_blocks / leaked_leases: KV blocks not back in their pools and leases (engines' and
  store nodes') still held once the cluster is idle after both phases;
- migrations: decode streams the router moved to another instance (``outcome="moved"``);
- restarts: processes the supervisor restarted;
- recovery_s_p99 (and recovery_s per fault): from the fault (for the freeze and the Redis
  outage: from its end) until every process is up and healthy, every instance reports to the
  router again, and the store nodes see Redis again.

    .venv/bin/python benchmarks/chaos.py [--model M] [--concurrency 4] [--freeze-s 20] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving_load import StreamError, chat_events  # noqa: E402
from services.launcher import Cluster, UpConfig, free_port  # noqa: E402
from services.pb import common_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc, prefill_pb2_grpc  # noqa: E402

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "AzureLLMInferenceTrace2023_conv.csv"
WORDS = ("river stone light harbor winter garden letter window morning story market mountain "
         "silver forest bridge engine signal thunder orchard lantern meadow compass velvet "
         "island whisper castle ember canyon festival quiet golden").split()
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["title", "year"]}


@dataclass(frozen=True)
class Request:
    index: int
    prompt: str
    max_tokens: int
    kind: str
    """greedy, seeded or json"""

    def body(self, model: str, salt: str) -> dict:
        body = {"model": model, "messages": [{"role": "user", "content": self.prompt}], "stream": True,
                "max_tokens": self.max_tokens, "return_token_ids": True, "cache_salt": salt,
                "stream_options": {"include_usage": True}, "temperature": 0}
        if self.kind == "seeded":
            body.update(temperature=0.8, top_k=40, seed=1000 + self.index)
        elif self.kind == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
        return body


@dataclass
class Outcome:
    token_ids: list[int] = field(default_factory=list)
    error: str = ""


def workload(num: int, seed: int, max_prompt: int, max_output: int) -> list[Request]:
    """Prompt and output lengths of the trace's first requests, scaled down; kinds mixed."""
    rng = random.Random(seed)
    rows = [line.split(",") for line in TRACE.read_text().splitlines()[1:num + 1]]
    requests = []
    for i, (_, context, generated) in enumerate(rows):
        num_words = max(8, min(max_prompt, int(context) // 4))
        prompt = "Tell me about " + " ".join(rng.choice(WORDS) for _ in range(num_words)) + "."
        kind = rng.choices(("greedy", "seeded", "json"), (0.45, 0.4, 0.15))[0]
        requests.append(Request(i, prompt, max(8, min(max_output, int(generated) // 2)), kind))
    return requests


async def one(client: httpx.AsyncClient, url: str, body: dict) -> Outcome:
    out = Outcome()
    finished = False
    try:
        async for event in chat_events(client, url, body):
            for choice in event.get("choices", ()):
                out.token_ids += choice.get("token_ids") or []
                finished = finished or bool(choice.get("finish_reason"))
    except StreamError as exc:
        return Outcome(out.token_ids, str(exc))
    except httpx.HTTPError as exc:
        return Outcome(out.token_ids, f"{type(exc).__name__}: {exc}")
    if not finished:
        out.error = "the stream ended without a finish reason"
    return out


async def run_phase(url: str, model: str, requests: list[Request], salt: str, concurrency: int,
                    until: asyncio.Future | None = None) -> dict[int, Outcome]:
    """Send ``requests`` in order, ``concurrency`` at a time; with ``until``, only until it is
    done (then the requests in flight finish)."""
    outcomes: dict[int, Outcome] = {}
    queue = list(requests)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        async def worker() -> None:
            while queue and (until is None or not until.done()):
                request = queue.pop(0)
                outcomes[request.index] = await one(client, url, request.body(model, salt))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


# ----- the cluster ------------------------------------------------------------------------------
class RedisServer:
    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            sys.exit("chaos.py needs redis-server (apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="epd-chaos-redis-")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                         "--save", "", "--appendonly", "no", "--dir", self.dir],
                                        stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


def metric(url: str, name: str, **labels: str) -> float:
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return math.nan
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def is_whole(cluster: Cluster, admin_url: str, headers: dict) -> bool:
    """Every process up and healthy, every instance reporting to the router, every store node
    seeing Redis."""
    if any(c.process.poll() is not None or c.healthy_since is None for c in cluster.children):
        return False
    try:
        instances = httpx.get(admin_url + "/admin/instances", headers=headers, timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return False
    if not all(i["healthy"] and not i["stale"] for i in instances):
        return False
    return all(metric(c.metrics_url, "epd_redis_available") == 1
               for c in cluster.children if c.name.startswith("kvstore"))


async def wait_whole(cluster: Cluster, admin_url: str, headers: dict, since: float, timeout_s: float = 300) -> float:
    while not await asyncio.to_thread(is_whole, cluster, admin_url, headers):
        if time.monotonic() - since > timeout_s:
            raise RuntimeError(f"the cluster was not whole again within {timeout_s:.0f} s")
        await asyncio.sleep(0.1)
    return time.monotonic() - since


def serving_decode(cluster: Cluster) -> str:
    """A decode instance that runs requests now (else decode-0)."""
    for child in cluster.children:
        if child.name.startswith("decode"):
            try:
                with grpc.insecure_channel(child.address) as channel:
                    load = decode_pb2_grpc.DecodeStub(channel).GetLoad(common_pb2.LoadRequest(), timeout=2)
                if load.num_running:
                    return child.name
            except grpc.RpcError:
                continue
    return "decode-0"


async def faults(cluster: Cluster, redis: RedisServer, admin_url: str, headers: dict, args) -> dict[str, float]:
    """The schedule; recovery seconds per fault."""
    recovery: dict[str, float] = {}

    async def kill(name: str) -> None:
        await asyncio.sleep(args.gap_s)
        child = cluster.child(name)
        dead = child.process
        print(f"  kill -9 {name} (pid {dead.pid})", flush=True)
        killed_at = time.monotonic()
        os.kill(dead.pid, signal.SIGKILL)
        await asyncio.to_thread(dead.wait)
        while child.process is dead:  # until the supervisor has started it again
            await asyncio.sleep(0.05)
        recovery[f"kill {name}"] = await wait_whole(cluster, admin_url, headers, killed_at)

    await kill(serving_decode(cluster))
    await kill("prefill-0")
    await kill("kvstore-0")
    await kill("encoder-0")
    await asyncio.sleep(args.gap_s)
    frozen = cluster.child(serving_decode(cluster))
    print(f"  SIGSTOP {frozen.name} for {args.freeze_s:g} s", flush=True)
    os.kill(frozen.process.pid, signal.SIGSTOP)
    await asyncio.sleep(args.freeze_s)
    os.kill(frozen.process.pid, signal.SIGCONT)
    recovery[f"freeze {frozen.name}"] = await wait_whole(cluster, admin_url, headers, time.monotonic())
    await asyncio.sleep(args.gap_s)
    print(f"  Redis down for {args.redis_down_s:g} s", flush=True)
    redis.stop()
    await asyncio.sleep(args.redis_down_s)
    redis.start()
    recovery["redis outage"] = await wait_whole(cluster, admin_url, headers, time.monotonic())
    await asyncio.sleep(args.gap_s)
    return recovery


def leftovers(cluster: Cluster, timeout_s: float = 60.0) -> tuple[int, int]:
    """(blocks out of their pools, leases held) once idle, waiting up to ``timeout_s`` for it."""
    deadline = time.monotonic() + timeout_s
    while True:
        blocks = leases = 0
        for child in cluster.children:
            role = child.name.split("-")[0]
            with grpc.insecure_channel(child.address) as channel:
                if role in ("prefill", "decode"):
                    stub = (prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub)(channel)
                    load = stub.GetLoad(common_pb2.LoadRequest(), timeout=5)
                    blocks += load.num_total_blocks - load.num_free_blocks
                    leases += load.num_leases
                elif role == "kvstore":
                    stats = kvstore_pb2_grpc.KVStoreStub(channel).GetStats(kvstore_pb2.StoreStatsRequest(), timeout=5)
                    leases += stats.num_leases
        if (blocks == 0 and leases == 0) or time.monotonic() > deadline:
            return blocks, leases
        time.sleep(0.2)


def compare(undisturbed: dict[int, Outcome], chaos: dict[int, Outcome]) -> dict[str, int]:
    lost = repeated = mismatched = 0
    for index, outcome in chaos.items():
        if outcome.error:
            continue
        reference = undisturbed[index].token_ids
        if outcome.token_ids == reference:
            continue
        mismatched += 1
        matched = sum(block.size for block in difflib.SequenceMatcher(
            None, reference, outcome.token_ids, autojunk=False).get_matching_blocks())
        lost += len(reference) - matched
        repeated += len(outcome.token_ids) - matched
    return {"tokens_lost": lost, "tokens_repeated": repeated, "mismatched_outputs": mismatched}


async def main(args) -> dict:
    redis = RedisServer()
    redis.start()
    config = UpConfig(model=args.model, prefills=2, decodes=2, encoders=1, kvstores=2, kvstore_replicas=2,
                      redis=redis.url, kvstore_dir="none", kvstore_capacity_mib=256, kv_cache_gib=args.kv_cache_gib,
                      port=free_port("127.0.0.1"), admin_port=free_port("127.0.0.1"), device="cpu")
    cluster = Cluster(config)
    try:
        url = await cluster.start()
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        stop = asyncio.Event()
        supervising = asyncio.ensure_future(cluster.supervise(stop))
        admin_url, headers = f"http://127.0.0.1:{config.admin_port}", {"Authorization": f"Bearer {cluster.admin_token}"}
        requests = workload(args.requests, args.seed, args.max_prompt_words, args.max_tokens)
        print(f"{len(requests)} requests ready; warm-up", flush=True)
        await run_phase(url, model, requests[:args.concurrency], "warm-up", args.concurrency)
        print("chaos phase", flush=True)
        started = time.monotonic()
        schedule = asyncio.ensure_future(faults(cluster, redis, admin_url, headers, args))
        chaos = await run_phase(url, model, requests, "chaos", args.concurrency, until=schedule)
        recovery = await schedule
        chaos_s = time.monotonic() - started
        sent = [r for r in requests if r.index in chaos]
        print(f"undisturbed phase: {len(sent)} requests", flush=True)
        undisturbed = await run_phase(url, model, sent, "undisturbed", args.concurrency)
        failed = {i: o.error for i, o in chaos.items() if o.error}
        baseline_failed = {i: o.error for i, o in undisturbed.items() if o.error}
        for index, error in list(failed.items())[:10]:
            print(f"  failed: request {index}: {error}", flush=True)
        leaked_blocks, leaked_leases = await asyncio.to_thread(leftovers, cluster)
        router = cluster.child("router")
        migrations = metric(router.metrics_url, "epd_router_migrations_total", outcome="moved")
        stop.set()
        await supervising
        times = sorted(recovery.values())
        return {"model": model, "requests": len(chaos), "failed": len(failed), **compare(undisturbed, chaos),
                "leaked_blocks": leaked_blocks, "leaked_leases": leaked_leases, "migrations": int(migrations),
                "restarts": sum(c.num_restarts for c in cluster.children),
                "recovery_s_p99": round(times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)], 2),
                "recovery_s": {k: round(v, 2) for k, v in recovery.items()},
                "baseline_failed": len(baseline_failed), "chaos_phase_s": round(chaos_s, 1)}
    finally:
        await asyncio.to_thread(cluster.stop)
        redis.stop()


def parse(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model name, GGUF file or HF directory (default SmolLM2)")
    parser.add_argument("--requests", type=int, default=400, help="requests available to the chaos phase")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64, help="cap on each request's output")
    parser.add_argument("--max-prompt-words", type=int, default=300)
    parser.add_argument("--gap-s", type=float, default=8.0, help="steady load before each fault")
    parser.add_argument("--freeze-s", type=float, default=20.0)
    parser.add_argument("--redis-down-s", type=float, default=10.0)
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="short gaps and freeze (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.gap_s, args.freeze_s, args.redis_down_s, args.max_tokens = 3.0, 8.0, 4.0, 24
    return args


if __name__ == "__main__":
    figures = asyncio.run(main(parse()))
    print(json.dumps(figures))
