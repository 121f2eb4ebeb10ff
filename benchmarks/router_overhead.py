"""Router overhead: the epd router in front of instant backends, beside the Rust sglang-router.

Both routers front backends that answer at once (``benchmarks/instant_servers.py``), so what
is measured is the router alone: its HTTP handling, and for epd also what SGLang does in its
workers instead (chat template, tokenizing, detokenizing) plus the two gRPC calls per request.

    wrk ──HTTP──> epd router (python -m services.router, its default policies) ──gRPC──> instant
                                                     Prefill: first token, no KV handle   prefill +
                                                     Decode.Generate: the rest, in chunks decode
    wrk ──HTTP──> sglang-router (Rust, regular mode, round robin) ──HTTP──> instant OpenAI server

The same load generator (``wrk``, one thread, keep-alive connections) sends the same request
to both: a non-streaming chat completion, one short user message, ``max_tokens`` 16, so both
return 16 tokens (checked once before measuring). Each point is --warmup-s of load, discarded,
then --duration-s measured, at each concurrency (open connections: 1, 64, 256); the two routers
alternate point by point so other load on the machine hits both alike. Every process (the two
routers, the two backends, wrk) is its own; none is pinned to a core: the epd router is one
Python process with one event loop, sglang-router one process whose Tokio runtime may use
both cores. What each router used is reported as ``*_router_cores`` (CPU seconds of its
process over the measured seconds), and each backend's as ``*_backend_cores``; a backend near
1.0 would be the bottleneck, not the router (then a warning is printed). On a 2-core machine
wrk and the backends share the cores with the router under test, so sglang-router's figure is a
lower bound of what it sustains alone (it stays under one core of the two): if anything the
ratio flatters epd.

Figures (the last line, JSON):
- ``epd_rps`` / ``sglang_router_rps``: the most successful requests per second over the
  concurrencies; ``rps_vs_sglang_router`` their ratio (goal >= 0.5);
- ``epd_added_ms_p50`` / ``_p99`` (goal p50 <= 2 ms): at concurrency 1, the through-router
  percentile minus the same percentile of the backend called directly, the same way, one request
  at a time: for epd a Python ``grpc.aio`` client making the router's two calls (Prefill, then
  Generate read to its end; same prompt length, same channel options), since the router's
  backend speaks only gRPC; for sglang, wrk against the instant OpenAI server (``direct_http_*``).
  So "added" is one extra hop plus everything the router does, for both. A difference of
  percentiles, not a percentile of differences;
- ``grpc_client_floor_rps``: the floor under any router written like epd's: one Python process
  (grpc.aio) making only the router's two gRPC calls per request, 64 loops at once, with no HTTP,
  tokenizer or policy work; ``grpc_client_floor_cores`` the CPU it used (all its threads);
  ``grpc_client_floor_vs_sglang_router`` and ``epd_vs_grpc_client_floor`` place epd between the
  two. When the floor itself is under half of sglang-router's rate, the rps goal cannot be met
  by any router that makes these calls through Python's grpc.aio;
- per concurrency C and router R: ``R_cC_rps``, ``R_cC_ms_p50``, ``R_cC_ms_p99``,
  ``R_cC_router_cores``, ``R_cC_backend_cores``, ``R_cC_errors``.

    .venv/bin/python benchmarks/router_overhead.py [--duration-s 5] [--warmup-s 2] [--tokens-per-chunk 4]
    .venv/bin/python benchmarks/router_overhead.py --quick   # 1 s points: every path runs, figures rough

Needs ``wrk`` (Debian package; installed with apt-get when missing and run as root) and the
``sglang-router`` package.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc.aio
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.sampling_params import SamplingParams  # noqa: E402
from services.common.server import CHANNEL_OPTIONS  # noqa: E402
from services.common.wire import DecodeRequest, RequestSpec, decode_request_to_proto, spec_to_proto  # noqa: E402
from services.launcher import free_port  # noqa: E402
from services.pb import decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc  # noqa: E402

CONCURRENCIES = (1, 64, 256)
FLOOR_CONCURRENCY = 64
"""Loops of the gRPC client floor (the rate is flat from ~32 loops up on two cores)."""
HOST = "127.0.0.1"
MAX_TOKENS = 16
BODY = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Say hello in a few words."}],
        "max_tokens": MAX_TOKENS}
WRK_SCRIPT = """wrk.method = "POST"
wrk.body = '%s'
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRK {"requests":%%d,"duration_us":%%d,"status":%%d,"connect":%%d,"read":%%d,' ..
    '"write":%%d,"timeout":%%d,"p50_us":%%d,"p99_us":%%d}\\n', summary.requests, summary.duration, e.status,
    e.connect, e.read, e.write, e.timeout, latency:percentile(50), latency:percentile(99)))
end
"""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
GOAL_RPS_RATIO = 0.5
GOAL_ADDED_MS_P50 = 2.0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- processes


@dataclass
class Proc:
    name: str
    process: subprocess.Popen
    log_path: Path

    def cpu_s(self) -> float:
        """CPU seconds used so far by the process (every thread)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def spawn(name: str, argv: list[str], workdir: Path, procs: list[Proc], ready_line: bool = False) -> tuple[Proc, dict]:
    """Start ``argv`` (output to a log file); with ``ready_line``, wait for its READY line."""
    log_path = workdir / f"{name}.log"
    with open(log_path, "wb") as out:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE if ready_line else out, stderr=out)
    proc = Proc(name, process, log_path)
    procs.append(proc)
    if not ready_line:
        return proc, {}
    line = process.stdout.readline().decode()
    if not line.startswith("READY "):
        raise SystemExit(f"{name} did not start:\n{proc.tail()}")
    return proc, json.loads(line[len("READY "):])


def check_answers(url: str, proc: Proc, timeout_s: float = 90.0) -> int:
    """Wait until ``url`` answers the benchmark's request with MAX_TOKENS tokens; its prompt tokens."""
    deadline = time.monotonic() + timeout_s
    reply = None
    while time.monotonic() < deadline:
        if proc.process.poll() is not None:
            raise SystemExit(f"{proc.name} exited ({proc.process.returncode}):\n{proc.tail()}")
        try:
            reply = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=5.0)
            if reply.status_code == 200:
                usage = reply.json()["usage"]
                if usage["completion_tokens"] != MAX_TOKENS:
                    raise SystemExit(f"{proc.name} answered {usage['completion_tokens']} tokens, not {MAX_TOKENS}")
                return usage["prompt_tokens"]
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"{proc.name} did not answer within {timeout_s:.0f} s (last: "
                     f"{reply.status_code if reply else None} {reply.text[:300] if reply else ''}):\n{proc.tail()}")


def ensure_tools() -> None:
    if shutil.which("wrk") is None:
        log("wrk is missing: apt-get install -y wrk")
        if os.geteuid() == 0:
            subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "wrk"], check=False,
                           capture_output=True)
        if shutil.which("wrk") is None:
            raise SystemExit("this benchmark needs wrk (the Debian package wrk): apt-get install -y wrk")
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise SystemExit("this benchmark needs the sglang-router package: "
                         ".venv/bin/python -m pip install sglang-router==0.3.2") from None


# ---------------------------------------------------------------- load and measurement


@dataclass(frozen=True)
class Point:
    rps: float
    ms_p50: float
    ms_p99: float
    errors: int
    router_cores: float = 0.0
    backend_cores: float = 0.0


def run_wrk(url: str, script: Path, concurrency: int, duration_s: float) -> dict:
    argv = ["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(duration_s))}s", "--timeout", "30s",
            "-s", str(script), url + "/v1/chat/completions"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    line = next((line for line in out.splitlines() if line.startswith("WRK ")), None)
    if line is None:
        raise SystemExit(f"wrk printed no summary:\n{out}")
    return json.loads(line[4:])


def measure(url: str, script: Path, concurrency: int, warmup_s: float, duration_s: float,
            router: Proc | None = None, backend: Proc | None = None) -> Point:
    if warmup_s > 0:
        run_wrk(url, script, concurrency, warmup_s)
    cpu = [p.cpu_s() if p else 0.0 for p in (router, backend)]
    w = run_wrk(url, script, concurrency, duration_s)
    seconds = w["duration_us"] / 1e6
    cores = [((p.cpu_s() - c) / seconds if p else 0.0) for p, c in zip((router, backend), cpu)]
    errors = w["status"] + w["connect"] + w["read"] + w["write"] + w["timeout"]
    return Point((w["requests"] - w["status"]) / seconds, w["p50_us"] / 1e3, w["p99_us"] / 1e3, errors, *cores)


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def direct_grpc(prefill: str, decode: str, num_prompt_tokens: int, warmup_s: float,
                      duration_s: float, concurrency: int = 1) -> Point:
    """The router's two calls made straight to the instant backends by ``concurrency`` loops.

    At concurrency 1 its percentiles are the baseline of "added" latency; at higher
    concurrency its rate is the floor's: what one Python process sustains making only the
    router's two gRPC calls per request (no HTTP, no tokenizer, no policy), and ``router_cores``
    the CPU it spent doing so (this process, every thread)."""
    spec = RequestSpec("direct", tuple(range(1000, 1000 + num_prompt_tokens)), SamplingParams(max_tokens=MAX_TOKENS))
    async with grpc.aio.insecure_channel(prefill, options=CHANNEL_OPTIONS) as p_channel, \
            grpc.aio.insecure_channel(decode, options=CHANNEL_OPTIONS) as d_channel:
        prefill_stub, decode_stub = prefill_pb2_grpc.PrefillStub(p_channel), decode_pb2_grpc.DecodeStub(d_channel)
        latencies: list[float] = []
        start = time.perf_counter()
        measured_from = start + warmup_s
        end = measured_from + duration_s

        async def loop() -> None:
            while (now := time.perf_counter()) < end:
                first = await prefill_stub.Prefill(prefill_pb2.PrefillRequest(spec=spec_to_proto(spec)))
                call = decode_stub.Generate(decode_request_to_proto(
                    DecodeRequest(spec, (first.first_token_id,), None, 0, prefill)))
                while (chunk := await call.read()) is not grpc.aio.EOF and not chunk.finish_reason:
                    pass
                if now >= measured_from:
                    latencies.append(time.perf_counter() - now)

        await asyncio.sleep(0)
        tasks = [asyncio.create_task(loop()) for _ in range(concurrency)]
        await asyncio.sleep(max(0.0, measured_from - time.perf_counter()))
        cpu = time.process_time()
        await asyncio.gather(*tasks)
        cores = (time.process_time() - cpu) / max(1e-9, time.perf_counter() - measured_from)
    latencies.sort()
    return Point(len(latencies) / duration_s, percentile(latencies, 0.5) * 1e3, percentile(latencies, 0.99) * 1e3, 0,
                 router_cores=cores)


# ---------------------------------------------------------------- the run


def start_all(workdir: Path, args: argparse.Namespace, procs: list[Proc]) -> dict:
    from services.engine.models.loader import resolve_model_dir  # torch: the model's directory, once
    tokenizer_dir = str(resolve_model_dir(None)[0])
    py = sys.executable
    grpc_backend, grpc_at = spawn("instant_grpc", [py, "benchmarks/instant_servers.py", "grpc", "--tokenizer-dir",
                                                   tokenizer_dir, "--tokens-per-chunk", str(args.tokens_per_chunk)],
                                  workdir, procs, ready_line=True)
    http_backend, http_at = spawn("instant_openai", [py, "benchmarks/instant_servers.py", "openai",
                                                     "--tokenizer-dir", tokenizer_dir], workdir, procs, ready_line=True)
    epd_port, sglang_port = free_port(HOST), free_port(HOST)
    epd, _ = spawn("epd_router", [py, "-m", "services.router", "--host", HOST, "--port", str(epd_port),
                                  "--admin-port", "0", "--prefill", grpc_at["prefill"], "--decode", grpc_at["decode"],
                                  *args.router_args.split()], workdir, procs)
    sglang, _ = spawn("sglang_router", [py, "-m", "sglang_router.launch_router", "--host", HOST, "--port",
                                        str(sglang_port), "--worker-urls", http_at["url"], "--policy", "round_robin",
                                        "--log-level", "warn"], workdir, procs)
    urls = {"epd": f"http://{HOST}:{epd_port}", "sglang": f"http://{HOST}:{sglang_port}"}
    num_prompt = check_answers(urls["epd"], epd)
    check_answers(urls["sglang"], sglang)
    log(f"up: epd router {urls['epd']}, sglang-router {urls['sglang']}; backends {grpc_at} {http_at}; "
        f"the request's prompt is {num_prompt} tokens")
    return {"urls": urls, "grpc_at": grpc_at, "http_at": http_at, "num_prompt": num_prompt,
            "procs": {"epd": (epd, grpc_backend), "sglang": (sglang, http_backend)}}


def run(args: argparse.Namespace, workdir: Path, procs: list[Proc]) -> dict:
    up = start_all(workdir, args, procs)
    script = workdir / "request.lua"
    script.write_text(WRK_SCRIPT % json.dumps(BODY, separators=(",", ":")))
    warm, dur = args.warmup_s, args.duration_s
    grpc_direct = asyncio.run(direct_grpc(up["grpc_at"]["prefill"], up["grpc_at"]["decode"], up["num_prompt"],
                                          warm, dur))
    http_direct = measure(up["http_at"]["url"], script, 1, warm, dur)
    floor = asyncio.run(direct_grpc(up["grpc_at"]["prefill"], up["grpc_at"]["decode"], up["num_prompt"],
                                    warm, dur, concurrency=FLOOR_CONCURRENCY))
    log(f"floor: a Python grpc.aio client alone making the router's two calls, {FLOOR_CONCURRENCY} loops: "
        f"{floor.rps:.0f} req/s on {floor.router_cores:.2f} cores")
    log(f"direct, concurrency 1: gRPC prefill+decode p50 {grpc_direct.ms_p50:.3f} ms p99 {grpc_direct.ms_p99:.3f} ms;"
        f" HTTP instant server p50 {http_direct.ms_p50:.3f} ms p99 {http_direct.ms_p99:.3f} ms")
    points: dict[tuple[str, int], Point] = {}
    for concurrency in CONCURRENCIES:
        for name in ("epd", "sglang"):
            router, backend = up["procs"][name]
            point = points[name, concurrency] = measure(up["urls"][name], script, concurrency, warm, dur,
                                                        router, backend)
            log(f"{name:>6} c={concurrency:<3} {point.rps:8.0f} req/s  p50 {point.ms_p50:8.3f} ms  "
                f"p99 {point.ms_p99:8.3f} ms  router {point.router_cores:.2f} cores  backend "
                f"{point.backend_cores:.2f} cores  errors {point.errors}")
            if point.backend_cores > 0.9:
                log(f"warning: the {name} backend used {point.backend_cores:.2f} cores: it may be the bottleneck")
    return figures(points, grpc_direct, http_direct, floor, args)


def figures(points: dict[tuple[str, int], Point], grpc_direct: Point, http_direct: Point, floor: Point,
            args: argparse.Namespace) -> dict:
    epd_rps = max(points["epd", c].rps for c in CONCURRENCIES)
    sglang_rps = max(points["sglang", c].rps for c in CONCURRENCIES)
    epd_1, sglang_1 = points["epd", 1], points["sglang", 1]
    result = {
        "epd_rps": round(epd_rps, 1), "sglang_router_rps": round(sglang_rps, 1),
        "rps_vs_sglang_router": round(epd_rps / sglang_rps, 4),
        "epd_added_ms_p50": round(epd_1.ms_p50 - grpc_direct.ms_p50, 3),
        "epd_added_ms_p99": round(epd_1.ms_p99 - grpc_direct.ms_p99, 3),
        "sglang_added_ms_p50": round(sglang_1.ms_p50 - http_direct.ms_p50, 3),
        "sglang_added_ms_p99": round(sglang_1.ms_p99 - http_direct.ms_p99, 3),
        "direct_grpc_ms_p50": round(grpc_direct.ms_p50, 3), "direct_grpc_ms_p99": round(grpc_direct.ms_p99, 3),
        "direct_http_ms_p50": round(http_direct.ms_p50, 3), "direct_http_ms_p99": round(http_direct.ms_p99, 3),
        "grpc_client_floor_rps": round(floor.rps, 1), "grpc_client_floor_cores": round(floor.router_cores, 2),
        "grpc_client_floor_vs_sglang_router": round(floor.rps / sglang_rps, 4),
        "epd_vs_grpc_client_floor": round(epd_rps / floor.rps, 4),
    }
    for (name, c), p in points.items():
        result.update({f"{name}_c{c}_rps": round(p.rps, 1), f"{name}_c{c}_ms_p50": round(p.ms_p50, 3),
                       f"{name}_c{c}_ms_p99": round(p.ms_p99, 3), f"{name}_c{c}_router_cores": round(p.router_cores, 2),
                       f"{name}_c{c}_backend_cores": round(p.backend_cores, 2), f"{name}_c{c}_errors": p.errors})
    result.update(goal_rps_met=result["rps_vs_sglang_router"] >= GOAL_RPS_RATIO,
                  goal_added_p50_met=result["epd_added_ms_p50"] <= GOAL_ADDED_MS_P50,
                  duration_s=args.duration_s, warmup_s=args.warmup_s, max_tokens=MAX_TOKENS,
                  tokens_per_chunk=args.tokens_per_chunk, router_args=args.router_args, cpus=os.cpu_count())
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=5.0, help="measured seconds per point (wrk: whole seconds)")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="discarded seconds of load before each point")
    parser.add_argument("--tokens-per-chunk", type=int, default=4,
                        help="tokens per decode stream chunk (the first token comes from prefill)")
    parser.add_argument("--router-args", default="", help="extra flags for the epd router, e.g. "
                        "'--prefill-policy round_robin --decode-policy round_robin'")
    parser.add_argument("--quick", action="store_true", help="1 s points, no warm-ups: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration_s, args.warmup_s = 1.0, 0.0
    ensure_tools()
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp:
        try:
            result = run(args, Path(tmp), procs)
        finally:
            for proc in reversed(procs):
                proc.stop()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
