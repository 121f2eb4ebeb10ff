"""Block-KV transfer throughput: our shm, tcp and nixl transports vs memcpy, a raw loopback socket and raw NIXL.

Fills KV blocks by running a real prompt through SmolLM2-135M (fp32 on the CPU: 737,280 bytes
a block), then moves 64 MiB of those blocks from an owner instance to a reader instance:

    parent process (the reader / "decode")           child process (the owner / "prefill")
    TransferEngine, destination region (anonymous)   TransferEngine + data server thread,
    shm: maps the owner's /dev/shm region file       source region in /dev/shm holding the KV,
    tcp: pulls from the owner's data server          a raw socket sender, optional Mooncake,
    nixl: one-sided UCX reads via NIXL               its NIXL agent (when nixl is installed)

The owner is a separate process (``kv_transfer_owner.py``), as it would be on a real deployment,
so its data server does not share the reader's GIL. Every transport read includes the checksum
check of every block.
Baselines, same bytes, same run: ``memcpy`` is the shm transport's copy primitive at its best
(np.copyto of the whole 64 MiB split over the same copy threads, no checksum) from the same
mapping of the owner's region file into the same destination; ``torch_copy`` is one torch
``copy_`` between anonymous (huge-page) buffers, for reference; ``socket`` is a raw loopback
TCP socket (child ``sendall`` of the 64 MiB, parent ``recv_into`` a preallocated buffer with
MSG_WAITALL), set up by the tcp transport's own ``wire.tune`` on both ends: blocking, kernel
timeouts (SO_RCVTIMEO / SO_SNDTIMEO, the transport's timeout), TCP_NODELAY, 4 MiB buffers. (A
Python socket timeout would make it non-blocking and split each read into many small ones,
which the transport avoids.) After one warm-up each, the
``--reps`` runs go round-robin over all columns so other load on the machine hits them alike;
headline numbers and ratios use each column's best run, medians are printed too. Mooncake (its
TCP protocol) and NIXL (UCX backend, which picks shared memory on one host) columns are filled
when those packages import, else null; they move the same blocks but verify no checksums, and
run after the main columns (their progress threads would load the cores the others use).
``nixl`` is our NIXL transport (checksums included), ``nixl_raw`` NIXL's own API driven
directly on the same bytes: a reader agent READs the blocks from the owner transport's agent
(the one the handle names), one request for all blocks, spinning on its state, no checksum.
Both agents come from ``kvstore.transfer.nixl.make_agent`` (UCX, 1 ms progress-thread sleep:
NIXL's default busy loop would take a whole core from whichever column runs). The two go
round-robin with each other after the main columns; null when nixl is not installed.
Last line: JSON (goals: shm_vs_memcpy >= 0.6, tcp_vs_socket >= 0.7, nixl_vs_raw >= 0.9).

    python benchmarks/kv_transfer.py [--target-mib 64] [--prompt-tokens N] [--reps 7]
    python benchmarks/kv_transfer.py --quick    # 4 MiB, 2 reps: every column runs, figures meaningless
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kv_transfer_owner import OWNER_LINE, TIMEOUT_S, TRANSPORTS  # noqa: E402
from kvstore.transfer import (  # noqa: E402
    BlockDesc, Endpoint, KVHandle, MemoryRegion, RegionDesc, TransferEngine, TransferState, wire)
from kvstore.transfer import nixl as nixl_transport  # noqa: E402  (imports nixl itself lazily)

OWNER_SCRIPT = Path(__file__).with_name("kv_transfer_owner.py")
NUM_COPY_THREADS = min(4, os.cpu_count() or 1)  # what the shm transport uses by default
SOCKET_SETUP = (f"wire.tune on both ends: blocking, SO_RCVTIMEO/SO_SNDTIMEO {TIMEOUT_S:g} s, TCP_NODELAY, "
                f"{wire.SOCKET_BUFFER_BYTES >> 20} MiB buffers")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def fill_kv_blocks(target_bytes: int, prompt_tokens: int | None) -> tuple[np.ndarray, str]:
    """(num_blocks, block_bytes) uint8 array of real KV, and a line saying how it was made."""
    import random

    import torch

    from services.engine import LLM, SamplingParams

    probe = LLM(None, num_kv_blocks=1)
    block_bytes = probe.engine.runner.kv_cache[0].numel() * probe.engine.runner.kv_cache.element_size()
    block_size = probe.engine.runner.block_size
    vocab = probe.engine.model_config.vocab_size
    del probe
    num_blocks = max(1, round(target_bytes / block_bytes))
    prompt_tokens = prompt_tokens or num_blocks * block_size
    llm = LLM(None, num_kv_blocks=prompt_tokens // block_size + 8, enable_prefix_caching=False)
    rng = random.Random(0)
    prompt = [rng.randrange(100, vocab) for _ in range(prompt_tokens)]  # low ids: special tokens
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    seconds = time.perf_counter() - start
    pool = llm.engine.runner.kv_cache
    flat = pool.reshape(pool.shape[0], -1)
    # The pool starts zeroed, so the blocks with any non-zero value are the ones the prompt wrote.
    computed = flat[(flat != 0).any(dim=1)].contiguous().view(torch.uint8).numpy()
    blocks = computed[np.arange(num_blocks) % len(computed)]  # tiles only if the prompt was short
    note = (f"{len(computed)} KV blocks ({block_bytes} B each) from a {prompt_tokens}-token prompt "
            f"in {seconds:.1f} s; moving {num_blocks} blocks = {blocks.nbytes / 2**20:.1f} MiB"
            + (" (tiled)" if num_blocks > len(computed) else ""))
    return np.ascontiguousarray(blocks), note


def start_owner(blocks: np.ndarray) -> tuple[subprocess.Popen, dict]:
    child = subprocess.Popen([sys.executable, str(OWNER_SCRIPT)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=False)
    setup = {"num_bytes": blocks.nbytes, "block_bytes": blocks.shape[1]}
    child.stdin.write(json.dumps(setup).encode() + b"\n")
    child.stdin.write(memoryview(blocks).cast("B"))
    child.stdin.flush()
    return child, owner_reply(child)


def owner_reply(child: subprocess.Popen, command: str | None = None) -> dict:
    if command is not None:
        child.stdin.write(command.encode() + b"\n")
        child.stdin.flush()
    for line in child.stdout:
        if line.startswith(OWNER_LINE.encode()):
            return json.loads(line[len(OWNER_LINE):])
    raise RuntimeError(f"owner process exited ({child.wait()}) without replying")


def handle_from_dict(d: dict) -> KVHandle:
    return KVHandle(d["lease_id"], Endpoint(**d["owner"]), tuple(RegionDesc(**r) for r in d["regions"]),
                    tuple(BlockDesc(**b) for b in d["blocks"]))


Run = Callable[[], None]


def run_interleaved(runs: dict[str, Run], reps: int) -> dict[str, list[float]]:
    """Seconds per run of each: the reps go round-robin, so load from other processes on the
    machine hits every column alike, and each timed run follows an untimed one of the same
    column. That first run after switching columns measures the switch, not the path: the
    scheduler has to move the sender and receiver threads of the new path apart again (a TCP
    read right after the raw socket's ran at ~0.6x its steady speed, and the socket after TCP
    likewise)."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            run()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def map_region(desc: RegionDesc) -> np.ndarray:
    """The owner's region file mapped read-only: the memory the shm transport copies from."""
    with open(desc.shm_path, "rb") as f:
        return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)


def memcpy_run(src: np.ndarray, dst: np.ndarray, num_threads: int, pool: ThreadPoolExecutor) -> Run:
    """The shm transport's copy primitive (np.copyto over its copy threads), whole buffer at once."""
    bounds = [len(src) * k // num_threads for k in range(num_threads + 1)]

    def part(k: int) -> None:
        np.copyto(dst[bounds[k]:bounds[k + 1]], src[bounds[k]:bounds[k + 1]])
    return lambda: list(pool.map(part, range(num_threads)))


def torch_copy_run(src: np.ndarray, dst: np.ndarray) -> Run:
    import torch
    s, d = torch.frombuffer(src, dtype=torch.uint8), torch.frombuffer(dst, dtype=torch.uint8)
    return lambda: d.copy_(s)


def transport_run(engine: TransferEngine, handle: KVHandle, dests: list, name: str) -> Run:
    def run() -> None:
        op = engine.read(handle, dests, transport=name)
        if op.wait(60) is not TransferState.DONE:
            raise RuntimeError(f"{name} read failed: {op.error}")
    return run


def socket_run(conn: socket.socket, dst: np.ndarray) -> Run:
    # As the tcp transport's reader does: connect with a timeout, then wire.tune, which makes the
    # socket blocking again (timeouts in the kernel), so one MSG_WAITALL call fills the buffer.
    wire.tune(conn, TIMEOUT_S, is_receiver=True)
    assert conn.getblocking(), "the raw socket must be blocking, like the transport's"
    view = memoryview(dst)

    def run() -> None:
        conn.send(b"x")
        got = 0
        while got < len(view):
            got += conn.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
    return run


def mooncake_run(info: dict, handle: KVHandle, base: int, dst: np.ndarray) -> Run:
    from mooncake.engine import TransferEngine as MooncakeEngine
    engine = MooncakeEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, "mooncake initialize"
    assert engine.register_memory(dst.ctypes.data, len(dst)) == 0, "mooncake register_memory"
    lengths = [b.length for b in handle.blocks]
    remote = [base + b.offset for b in handle.blocks]
    local = [dst.ctypes.data + b.offset for b in handle.blocks]

    def run() -> None:
        rc = engine.batch_transfer_sync_read(info["session"], local, remote, lengths)
        assert rc == 0, f"mooncake read returned {rc}"
    run.engine = engine  # keep it alive as long as the closure
    return run


def nixl_raw_run(handle: KVHandle, dst: np.ndarray) -> Run:
    """NIXL's API alone: READ every block from the owner's agent into ``dst``, no checksum."""
    info = nixl_transport.PeerInfo.decode(handle.owner.nixl)
    agent = nixl_transport.make_agent("bench-raw-reader")
    agent.register_memory([(dst.ctypes.data, len(dst), 0, "")], "DRAM")
    owner = agent.add_remote_agent(info.metadata)
    local = agent.get_xfer_descs([(dst.ctypes.data + b.offset, b.length, 0) for b in handle.blocks], "DRAM")
    remote = agent.get_xfer_descs([(info.regions[b.region_id][0] + b.offset, b.length, 0)
                                   for b in handle.blocks], "DRAM")

    def run() -> None:
        xfer = agent.initialize_xfer("READ", local, remote, owner)
        state = agent.transfer(xfer)
        while state == "PROC":
            state = agent.check_xfer_state(xfer)
        agent.release_xfer_handle(xfer)
        assert state == "DONE", "nixl transfer failed"
    run.agent = agent
    return run


def optional(name: str, child: subprocess.Popen, make: Callable[[dict], Run], reps: int) -> list[float] | None:
    """Times of an optional column, or None (with the reason on stderr) when it cannot run here."""
    try:
        info = owner_reply(child, name)
        if "error" in info:
            log(f"{name}: unavailable ({info['error']})")
            return None
        run = make(info)
        return run_interleaved({name: run}, reps)[name]
    except Exception as exc:
        log(f"{name}: failed ({type(exc).__name__}: {exc})")
        return None


def gbps(num_bytes: int, times: list[float] | None, pick=min) -> float | None:
    return None if times is None else round(num_bytes / pick(times) / 1e9, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-mib", type=float, default=64.0)
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="default: enough tokens to fill --target-mib with computed blocks")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 MiB, 2 reps (overrides both)")
    args = parser.parse_args()
    if args.quick:
        args.target_mib, args.reps = 4.0, 2

    blocks, note = fill_kv_blocks(int(args.target_mib * 2**20), args.prompt_tokens)
    log(note)
    child, info = start_owner(blocks)
    try:
        times = measure(child, info, blocks.reshape(-1), args.reps)
    finally:
        child.stdin.close()
        child.wait(30)
    report(times, blocks.nbytes, args.reps)


def measure(child: subprocess.Popen, info: dict, source: np.ndarray, reps: int) -> dict[str, list[float] | None]:
    reader = TransferEngine(timeout_s=TIMEOUT_S, transports=TRANSPORTS)
    dest = MemoryRegion.allocate(len(source), shm=False)
    reader.register(dest)  # as a decode instance registers its pool (NIXL reads need it registered)
    pool = ThreadPoolExecutor(NUM_COPY_THREADS)
    conn = socket.create_connection(("127.0.0.1", info["socket_port"]), timeout=TIMEOUT_S)
    handle = handle_from_dict(info["handle"])
    dests = [dest.buffer[b.offset:b.offset + b.length] for b in handle.blocks]
    try:
        # torch_copy alone first: torch's OpenMP workers spin on after each op and would slow
        # whichever column ran next.
        times: dict[str, list[float] | None] = run_interleaved(
            {"torch_copy": torch_copy_run(source, dest.buffer)}, reps)
        time.sleep(1)
        runs = {
            "memcpy": memcpy_run(map_region(handle.regions[0]), dest.buffer, NUM_COPY_THREADS, pool),
            "shm": transport_run(reader, handle, dests, "shm"),
            "tcp": transport_run(reader, handle, dests, "tcp"),
            "socket": socket_run(conn, dest.buffer),
        }
        times.update(run_interleaved(runs, reps))
        for name in ("shm", "tcp"):
            dest.buffer[:] = 0
            runs[name]()
            assert np.array_equal(dest.buffer, source), f"the {name} read landed different bytes"
        dest.buffer[:] = 0
        times["mooncake_tcp"] = optional("mooncake", child,
                                         lambda i: mooncake_run(i, handle, info["base"], dest.buffer), reps)
        if times["mooncake_tcp"] is not None and not np.array_equal(dest.buffer, source):
            log("mooncake: landed different bytes; column dropped")
            times["mooncake_tcp"] = None
        times.update(measure_nixl(reader, handle, dests, dest.buffer, source, reps))
        return times
    finally:
        conn.close()
        pool.shutdown()
        reader.close()
        dest.close()


def measure_nixl(reader: TransferEngine, handle: KVHandle, dests: list, dst: np.ndarray,
                 source: np.ndarray, reps: int) -> dict[str, list[float] | None]:
    """Our nixl transport and NIXL's raw API, round-robin with each other; None without nixl."""
    if "nixl" not in TRANSPORTS or not handle.owner.nixl:
        log("nixl: unavailable (not installed, or the owner exported no NIXL endpoint)")
        return {"nixl": None, "nixl_raw": None}
    runs = {"nixl": transport_run(reader, handle, dests, "nixl"), "nixl_raw": nixl_raw_run(handle, dst)}
    times: dict[str, list[float] | None] = dict(run_interleaved(runs, reps))
    for name, run in runs.items():
        dst[:] = 0
        run()
        if not np.array_equal(dst, source):
            log(f"{name}: landed different bytes; column dropped")
            times[name] = None
    return times


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a / b, 3)


def report(results: dict[str, list[float] | None], num_bytes: int, reps: int) -> None:
    log(f"socket and tcp: loopback TCP, {SOCKET_SETUP}")
    for name, times in results.items():
        if times is not None:
            log(f"{name:>13}: best {gbps(num_bytes, times):6.2f} GB/s, median "
                f"{gbps(num_bytes, times, statistics.median):6.2f} GB/s ({reps} runs)")
    best = {f"{name}_gbps": gbps(num_bytes, times) for name, times in results.items()}
    medians = {f"{name}_median_gbps": gbps(num_bytes, times, statistics.median) for name, times in results.items()}
    print(json.dumps({
        **best,
        "shm_vs_memcpy": round(best["shm_gbps"] / best["memcpy_gbps"], 3),
        "shm_vs_torch_copy": round(best["shm_gbps"] / best["torch_copy_gbps"], 3),
        "tcp_vs_socket": round(best["tcp_gbps"] / best["socket_gbps"], 3),
        "nixl_vs_raw": ratio(best["nixl_gbps"], best["nixl_raw_gbps"]),
        "nixl_vs_memcpy": ratio(best["nixl_gbps"], best["memcpy_gbps"]),
        "nixl_vs_shm": ratio(best["nixl_gbps"], best["shm_gbps"]),
        **medians,
        "num_bytes": num_bytes,
        "socket_setup": SOCKET_SETUP,
        "stat": f"best of {reps} (after 1 warm-up)",
    }))


if __name__ == "__main__":
    main()
