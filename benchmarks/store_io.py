"""KV store put/get throughput of 112 KiB blocks through its real data path vs Redis SET/GET,
each over the same kind of transport: store over shared memory vs Redis over a unix socket
(one machine, no network stack), store over TCP vs Redis over TCP (loopback).

Both servers run on this machine, both keep the blocks in memory only, both are fed the same
blocks from the same caller memory and land them in the same caller memory, in batches of
the same size:

    this process (the engine)                          servers
    writer region (/dev/shm) holding the blocks   -->  store node (python -m services.kvstore):
      put = export(ranges) + StoreClient.put             reads the blocks one-sided (shm or tcp),
                                                          checks every checksum, keeps them
      get = acquire_prefix + TransferEngine.read    <--  lends its host slots under a lease
            (checksums checked) + release_soon           (one node: no lookup round trip)
    the same blocks, the same batch size          -->  redis-server (--save "" --appendonly no,
      put = pipelined SET of each block                  a TCP port and a unix socket):
      get = pipelined GET, copied into the dest     <--  keeps them in its heap

Columns (each a put and a get):

    store_shm   the engine's TransferEngine as is: the node maps the writer's /dev/shm region
                file, the reader maps the node's (control messages over gRPC/TCP either way)
    store_tcp   a TransferEngine with only the tcp transport, under another host id, so the
                node pulls from its data server and it pulls from the node's: what a writer
                on another machine gets (loopback TCP here)
    redis_tcp   redis-py (+ hiredis when installed) over loopback TCP
    redis_unix  redis-py over the same server's unix socket

NIXL: not available here (no package); no column.

Every put of the timed loop is of new blocks (fresh hashes each round and column, the store's
block count is checked after every round), so the store copies each one rather than renewing
it. After one untimed warm-up round, --reps rounds each run every column's put, then every
column's get, in an order that rotates round by round, so other load on the machine hits all
alike; headline numbers use each column's best round, medians are printed too. Every landed
block is compared with its source once per round and column.
Last line: JSON with every column and the like-for-like ratios put/get_shm_vs_redis_unix and
put/get_tcp_vs_redis_tcp (goal: >= 1).

    .venv/bin/python benchmarks/store_io.py [--num-blocks 1024] [--batch-blocks 64] [--reps 5]
    .venv/bin/python benchmarks/store_io.py --quick   # 64 blocks, 1 round: every column runs, figures meaningless
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable

import grpc.aio
import numpy as np
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.hashing import BlockHash  # noqa: E402
from kvstore.transfer import MemoryRegion, TransferEngine, TransferState  # noqa: E402
from services.common.server import wait_for_health  # noqa: E402
from services.kvstore.client import StoreClient  # noqa: E402
from services.launcher import free_port, remove_shared_memory_of  # noqa: E402
from services.pb import kvstore_pb2, kvstore_pb2_grpc  # noqa: E402

BLOCK_BYTES = 112 << 10
HOST = "127.0.0.1"
OTHER_HOST_ID = "store-io-bench-remote"  # makes the node treat the tcp column's writer as another machine
TRANSPORTS = {
    "store_shm": "shared memory (/dev/shm mapping; gRPC control over TCP)",
    "store_tcp": "loopback TCP (transfer engine's tcp transport; gRPC control over TCP)",
    "redis_tcp": "loopback TCP (redis-py)",
    "redis_unix": "unix socket (redis-py)",
}
PAIRS = (("shm", "store_shm", "redis_unix"), ("tcp", "store_tcp", "redis_tcp"))  # like-for-like ratios


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the two servers


def start_store(block_bytes: int, capacity_mib: int, log_file) -> tuple[subprocess.Popen, str]:
    port = free_port(HOST)
    process = subprocess.Popen(
        [sys.executable, "-m", "services.kvstore", "--host", HOST, "--port", str(port), "--metrics-port", "none",
         "--node-id", "bench", "--host-capacity-mib", str(capacity_mib), "--block-bytes", str(block_bytes)],
        cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    return process, f"{HOST}:{port}"


def start_redis(directory: str) -> tuple[subprocess.Popen, redis.Redis, redis.Redis]:
    """One redis-server listening on a loopback port and a unix socket; a client for each."""
    port, unix_path = free_port(HOST), str(Path(directory) / "redis.sock")
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", HOST, "--unixsocket", unix_path,
                                "--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--dir", directory],
                               stdout=subprocess.DEVNULL)
    over_tcp, over_unix = redis.Redis(host=HOST, port=port), redis.Redis(unix_socket_path=unix_path)
    deadline = time.monotonic() + 10
    while True:
        try:
            over_tcp.ping()
            over_unix.ping()
            return process, over_tcp, over_unix
        except redis.ConnectionError:
            if time.monotonic() > deadline or process.poll() is not None:
                stop(process)
                raise RuntimeError("redis-server did not start (is it installed? apt-get install redis-server)")
            time.sleep(0.05)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    remove_shared_memory_of(process.pid)  # only left behind if it had to be killed


# ---------------------------------------------------------------- one round of each column


class Blocks:
    """The blocks every column moves: a source (the writer's region in /dev/shm, registered
    with both transfer engines) and a destination (anonymous caller memory), both
    ``num_blocks`` x ``block_bytes``."""

    def __init__(self, num_blocks: int, block_bytes: int, batch_blocks: int) -> None:
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.source = MemoryRegion.allocate(num_blocks * block_bytes)
        self.dest = MemoryRegion.allocate(num_blocks * block_bytes, shm=False)
        self.source.buffer[:] = np.random.default_rng(0).integers(0, 256, len(self.source.buffer), dtype=np.uint8)
        self.batches = [range(start, min(start + batch_blocks, num_blocks))
                        for start in range(0, num_blocks, batch_blocks)]

    def src(self, i: int) -> np.ndarray:
        return self.source.buffer[i * self.block_bytes:(i + 1) * self.block_bytes]

    def dst(self, i: int) -> np.ndarray:
        return self.dest.buffer[i * self.block_bytes:(i + 1) * self.block_bytes]

    def check_landed(self, column: str) -> None:
        assert np.array_equal(self.dest.buffer, self.source.buffer), f"{column} landed different bytes"
        self.dest.buffer[:] = 0

    def close(self) -> None:
        self.source.close()
        self.dest.close()


class StoreColumn:
    """Put and get exactly as an engine does: the engine's client, its transfer engine; the
    read of a get forced to ``transport`` (it fails rather than fall back to another)."""

    def __init__(self, client: StoreClient, transfer: TransferEngine, blocks: Blocks, transport: str) -> None:
        self.client, self.transfer, self.blocks, self.transport = client, transfer, blocks, transport

    async def put(self, hashes: list[BlockHash]) -> None:
        b = self.blocks
        for batch in b.batches:
            handle = self.transfer.export(b.source.region_id, [(i * b.block_bytes, b.block_bytes) for i in batch],
                                          lease_id=f"put-{hashes[batch[0]].hex()[:16]}")
            num_put = await self.client.put([hashes[i] for i in batch], handle)
            assert num_put == len(batch), f"the store kept {num_put} of {len(batch)} blocks"

    async def get(self, hashes: list[BlockHash]) -> None:
        for batch in self.blocks.batches:
            lent = await self.client.acquire_prefix([hashes[i] for i in batch])
            try:
                ops = [self.transfer.read(item.handle, [self.blocks.dst(batch[j]) for j in item.indices],
                                          transport=self.transport) for item in lent]
                for op in ops:
                    if op.wait(60) is not TransferState.DONE:
                        raise RuntimeError(f"store read over {self.transport} failed: {op.error}")
            finally:
                self.client.release_soon(lent)
            num_got = sum(len(item.indices) for item in lent)
            assert num_got == len(batch), f"the store lent {num_got} of {len(batch)} blocks"


class RedisColumn:
    """SET / GET of each block, one pipeline per batch; a GET's bytes are copied into the
    destination, so both columns end with the blocks in the caller's memory."""

    def __init__(self, client: redis.Redis, blocks: Blocks) -> None:
        self.client, self.blocks = client, blocks

    async def put(self, keys: list[bytes]) -> None:
        for batch in self.blocks.batches:
            pipe = self.client.pipeline(transaction=False)
            for i in batch:
                pipe.set(keys[i], memoryview(self.blocks.src(i)))  # sent as is, no copy
            assert all(pipe.execute()), "a Redis SET failed"

    async def get(self, keys: list[bytes]) -> None:
        for batch in self.blocks.batches:
            pipe = self.client.pipeline(transaction=False)
            for i in batch:
                pipe.get(keys[i])
            for i, value in zip(batch, pipe.execute()):
                self.blocks.dst(i)[:] = np.frombuffer(value, dtype=np.uint8)


# ---------------------------------------------------------------- the rounds

Column = StoreColumn | RedisColumn


async def timed(run: Callable[[list], Awaitable[None]], keys: list) -> float:
    start = time.perf_counter()
    await run(keys)
    return time.perf_counter() - start


def fresh_keys(seed: int, num_blocks: int) -> list[BlockHash]:
    raw = np.random.default_rng(seed).bytes(32 * num_blocks)
    return [BlockHash(raw[32 * i:32 * (i + 1)]) for i in range(num_blocks)]


async def measure(columns: dict[str, Column], blocks: Blocks, stats: kvstore_pb2_grpc.KVStoreStub,
                  redis_client: redis.Redis, reps: int) -> dict[str, list[float]]:
    """Seconds per round of each column's put and get; round 0 is a warm-up and is not kept."""
    names = list(columns)
    times: dict[str, list[float]] = {f"{name}_{op}": [] for op in ("put", "get") for name in names}
    num_store_columns = sum(isinstance(c, StoreColumn) for c in columns.values())
    for rep in range(reps + 1):
        order = names[rep % len(names):] + names[:rep % len(names)]
        # New keys every round and column: a put of blocks the store already holds only renews them.
        keys = {name: fresh_keys(1 + rep * len(names) + k, blocks.num_blocks) for k, name in enumerate(names)}
        round_times = {f"{name}_put": await timed(columns[name].put, keys[name]) for name in order}
        node = await stats.GetStats(kvstore_pb2.StoreStatsRequest(), timeout=10)
        expected = (rep + 1) * num_store_columns * blocks.num_blocks
        assert node.num_blocks == expected, f"store holds {node.num_blocks} blocks, not {expected}: it renewed some"
        for name in order:
            round_times[f"{name}_get"] = await timed(columns[name].get, keys[name])
            blocks.check_landed(f"{name} get")
        redis_client.flushdb()  # keeps Redis's memory bounded (the store is sized for every round)
        if rep > 0:
            for name, seconds in round_times.items():
                times[name].append(seconds)
        log(f"round {rep}{' (warm-up)' if rep == 0 else ''}: " + ", ".join(
            f"{name} {blocks.num_blocks * blocks.block_bytes / round_times[name] / 1e9:.2f}" for name in times)
            + " GB/s")
    return times


async def run(args: argparse.Namespace) -> tuple[dict[str, list[float]], int]:
    num_bytes = args.num_blocks * args.block_bytes
    # Every round's blocks of both store columns stay in the store (no eviction on the put
    # path), plus staging room.
    capacity_mib = -(-num_bytes * 2 * (args.reps + 1) // 2**20) + 16
    with tempfile.TemporaryFile() as store_log, tempfile.TemporaryDirectory(prefix="epd-bench-redis-") as redis_dir:
        store_process, address = start_store(args.block_bytes, capacity_mib, store_log)
        redis_process, redis_clients, engines, blocks, client, channel = None, (), [], None, None, None
        try:
            if not await wait_for_health(address, "epd.v1.KVStore", timeout_s=60):
                store_log.seek(0)
                raise RuntimeError(f"the store node did not start:\n{store_log.read().decode()[-3000:]}")
            redis_process, *redis_clients = start_redis(redis_dir)
            engines.append(TransferEngine())
            engines.append(TransferEngine(transports=("tcp",), host_id=OTHER_HOST_ID))
            blocks = Blocks(args.num_blocks, args.block_bytes, args.batch_blocks)
            for engine in engines:
                engine.register(blocks.source)
            client = StoreClient([address])
            channel = grpc.aio.insecure_channel(address)
            log(f"{args.num_blocks} blocks of {args.block_bytes} B = {num_bytes / 2**20:.0f} MiB a round, "
                f"{args.batch_blocks} blocks an operation; store node with {capacity_mib} MiB of host memory")
            for name, transport in TRANSPORTS.items():
                log(f"{name:>10}: {transport}")
            log("NIXL: not available")
            columns: dict[str, Column] = {
                "store_shm": StoreColumn(client, engines[0], blocks, "shm"),
                "store_tcp": StoreColumn(client, engines[1], blocks, "tcp"),
                "redis_tcp": RedisColumn(redis_clients[0], blocks),
                "redis_unix": RedisColumn(redis_clients[1], blocks),
            }
            times = await measure(columns, blocks, kvstore_pb2_grpc.KVStoreStub(channel), redis_clients[0],
                                  args.reps)
            return times, num_bytes
        finally:
            for closer in (client, channel):
                if closer is not None:
                    await closer.close()
            for redis_client in redis_clients:
                redis_client.close()
            for engine in engines:
                engine.close()
            if blocks is not None:
                blocks.close()
            if redis_process is not None:
                stop(redis_process)
            stop(store_process)


def gb_s(num_bytes: int, times: list[float], pick=min) -> float:
    return round(num_bytes / pick(times) / 1e9, 3)


def report(times: dict[str, list[float]], num_bytes: int, args: argparse.Namespace) -> None:
    for name, seconds in times.items():
        column = name.rsplit("_", 1)[0]
        log(f"{name:>14}: best {gb_s(num_bytes, seconds):6.2f} GB/s, median "
            f"{gb_s(num_bytes, seconds, statistics.median):6.2f} GB/s ({args.reps} rounds)  over {TRANSPORTS[column]}")
    best = {f"{name}_gb_s": gb_s(num_bytes, seconds) for name, seconds in times.items()}
    ratios = {f"{op}_{kind}_vs_{redis_column}": round(best[f"{store}_{op}_gb_s"] / best[f"{redis_column}_{op}_gb_s"], 3)
              for kind, store, redis_column in PAIRS for op in ("put", "get")}
    for name, ratio in ratios.items():
        log(f"{name}: {ratio:.2f}x")
    print(json.dumps({
        **ratios,
        **best,
        **{f"{name}_median_gb_s": gb_s(num_bytes, seconds, statistics.median) for name, seconds in times.items()},
        "transports": TRANSPORTS,
        "nixl": "not available",
        "block_bytes": args.block_bytes,
        "num_blocks": args.num_blocks,
        "batch_blocks": args.batch_blocks,
        "stat": f"best of {args.reps} (after 1 warm-up)",
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=1024, help="blocks moved per round and column")
    parser.add_argument("--batch-blocks", type=int, default=64, help="blocks per put / get operation")
    parser.add_argument("--block-bytes", type=int, default=BLOCK_BYTES)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 64 blocks, 32 an operation, 1 round after the warm-up (overrides those)")
    args = parser.parse_args()
    if args.quick:
        args.num_blocks, args.batch_blocks, args.reps = 64, 32, 1
    if min(args.num_blocks, args.batch_blocks, args.block_bytes, args.reps) < 1:
        parser.error("--num-blocks, --batch-blocks, --block-bytes and --reps must all be >= 1")
    times, num_bytes = asyncio.run(run(args))
    report(times, num_bytes, args)


if __name__ == "__main__":
    main()
