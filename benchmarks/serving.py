"""Serving: ``epd up`` beside vLLM's CPU OpenAI server, the same streamed chat load against each.

The load is issue 22's (NVIDIA's aiperf 0.13 measured it from outside): streamed chat
completions, prompts of exactly --prompt-tokens tokens (256) of user content by the model's own
tokenizer, exactly --output-tokens (64) out (``max_tokens`` with ``min_tokens`` and
``ignore_eos``, which both servers take), --concurrency (8) requests in flight until --requests
(48) are done. SmolLM2-135M-Instruct, fp32 (--dtype: both servers), on this machine's CPU cores:

    load client ──HTTP──> epd up (defaults: router, 1 prefill, 1 decode, 1 KV store node)
    load client ──HTTP──> vLLM (.venv-vllm: python -m vllm.entrypoints.openai.api_server,
                                --dtype float32, --no-enable-prefix-caching, OpenMP threads
                                bound to every usable core)

One server at a time: start it (its own session, free ports), wait until it answers, warm it
up with --concurrency requests (not timed), run the timed load, stop it (SIGINT, then SIGKILL
to every process of its session) and check no process of it is left. --repeats N does that N
times for each server, the order alternating (epd first in even repeats, vLLM in odd ones), each
run a fresh start in a directory of its own (so epd's KV store starts empty every time): on a
noisy machine the medians of 3 say more than one run (docs/BENCHMARKS.md's figures).

The load client: aiperf 0.13 itself where it is installed (``.peers/aiperf``, its own venv,
which ``make bench-peers`` creates), sending its synthetic prompts (Shakespeare sonnet text,
--random-seed fixed, so the same prompts for both servers); else (or with ``--client own``) our
own httpx client (serving_load.py), measuring as aiperf does: TTFT from sending the request to
the first chunk with content; a request's inter-token latency (ITL) (end of the stream - that
chunk) / (output tokens - 1), so a server that streams several tokens per chunk is measured
alike; output throughput every output token (the usage chunk's count) over the timed load's wall
time. Its prompts are random one-token words of the tokenizer's, drawn with a fixed seed, so
each encodes to exactly --prompt-tokens tokens. Either way one prompt per request, none repeated
(the warm-up has its own), and every server counts the chat template's tokens on top (about 30).
aiperf's concurrency mode issues each request the moment a slot frees by polling its event loop
without pause: about 0.65 of a core busy for the whole run (1/3 of a 2-core machine, taken from
the server under test). --aiperf-rate R (``aiperf_rate`` in the JSON) paces it instead
(--request-rate R, constant, still --concurrency at most in flight: a freed slot waits at most
1/R s; R = 200 kept the client under 0.1 of a core).

Prefix caching: vLLM's is off. epd's stays at its default, on (each engine's block cache and the
KV store node): with prompts that differ from their first words only the chat template's system
preamble (one 16-token block) is shared, which ``S_prompt_cached_pct`` shows (prompt tokens the
server reports cached). The store node's disk tier is a temporary directory, so a rerun finds
nothing left by the previous one.

Figures (the last line, JSON), for S in epd, vllm: ``S_output_tok_s``, ``S_ttft_ms_p50``,
``S_ttft_ms_p99``, ``S_itl_ms_mean``, ``S_itl_ms_p50``, ``S_requests``, ``S_errors``,
``S_wrong_lengths`` (requests that did not give exactly --output-tokens), ``S_prompt_cached_pct``,
``S_processes_left`` (0), ``S_load_avg_1m`` (the machine's, as the timed load began): with
--repeats the counts (requests, errors, wrong lengths, processes left) summed over the runs and
every other figure their median; then ``throughput_vs_vllm``, ``ttft_p99_vs_vllm`` and
``itl_vs_vllm`` (mean ITL), epd over vLLM from those medians (with --repeats, each repeat's own
ratios too, as ``throughput_vs_vllm_runs`` and so on: ahead in every pair or not), null
when vLLM is absent (``vllm_absent`` says why: --no-vllm, not installed, or it did not come up
or answer: never an error), and ``cpu``, what they were taken on. On a 2-core machine shared
with other work, with the load client on the same cores, the figures are indicative only.

    .venv/bin/python benchmarks/serving.py [--requests 48] [--concurrency 8] [--prompt-tokens 256]
        [--output-tokens 64] [--repeats 1] [--no-vllm] [--client auto|own|aiperf] [--epd-args '--prefills 2']
        [--aiperf-rate 200] [--keep DIR]   # DIR: each run's server logs, aiperf's per-request records
    .venv/bin/python benchmarks/serving.py --quick   # a tiny load, about a minute per server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.peers import (PEERS_DIR, VLLM_READY, VLLM_VENV, PeerUnavailable, cpu_info, cpu_ranges,  # noqa: E402
                              log_tail, session_pids, usable_cpus)
from benchmarks.serving_load import (MODEL_NAME, REQUEST_TIMEOUT_S, figures, log, make_prompts,  # noqa: E402
                                     run_load)
from services.launcher import free_port  # noqa: E402

HOST = "127.0.0.1"
SEED = 22
AIPERF = PEERS_DIR / "aiperf" / "bin" / "aiperf"
VLLM_KV_CACHE_GIB = 2
EPD_START_TIMEOUT_S = 600.0
VLLM_START_TIMEOUT_S = 900.0
"""vLLM's CPU set-up (and its first compile) on two busy cores has taken minutes."""
STOP_GRACE_S = 45.0


# ---------------------------------------------------------------- servers


@dataclass
class Server:
    """A server process in a session of its own: every process it starts can be found and stopped."""

    name: str
    argv: list[str]
    env: dict[str, str]
    url: str
    log_path: Path
    process: subprocess.Popen | None = None

    def start(self) -> None:
        log(f"{self.name}: starting (log {self.log_path})")
        with open(self.log_path, "wb") as out:
            self.process = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        """Until GET /v1/models answers 200; PeerUnavailable if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PeerUnavailable(f"{self.name} exited with {self.process.returncode}: "
                                      f"{log_tail(self.log_path, 8)}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise PeerUnavailable(f"{self.name} did not answer within {timeout_s:.0f} s: {log_tail(self.log_path, 8)}")

    def stop(self) -> int:
        """SIGINT to the server (it stops its own children), SIGKILL to whatever of its session is
        left after the grace period; the number of its processes still alive after that (0)."""
        if self.process is None:
            return 0
        session = self.process.pid
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + STOP_GRACE_S
        while session_pids(session) and time.monotonic() < deadline:
            time.sleep(0.2)
            self.process.poll()   # reaps the leader once it exits
        if session_pids(session):
            log(f"{self.name}: still running after {STOP_GRACE_S:.0f} s: SIGKILL to its session")
            for pid in session_pids(session):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.process.wait()
            time.sleep(0.5)
        self.process.wait()
        return len(session_pids(session))


def epd_server(workdir: Path, dtype: str, extra_args: str) -> Server:
    port, admin_port = free_port(HOST), free_port(HOST)
    script = Path(sys.executable).with_name("epd")   # the console script; without it, what it runs
    epd = [str(script)] if script.exists() else [sys.executable, "-m", "services.cli"]
    argv = [*epd, "up", "--host", HOST, "--port", str(port), "--dtype", dtype,
            "--admin-port", str(admin_port), "--kvstore-dir", str(workdir / "kvstore"), *shlex.split(extra_args)]
    return Server("epd", argv, dict(os.environ), f"http://{HOST}:{port}", workdir / "epd.log")


def vllm_server(workdir: Path, model_dir: Path, dtype: str, max_model_len: int) -> Server:
    """Raises PeerUnavailable when .venv-vllm is not installed."""
    if not VLLM_READY.exists():
        raise PeerUnavailable(f"{VLLM_READY} missing: run `make setup-vllm`")
    port = free_port(HOST)
    env = {**os.environ,
           # vLLM's CPU backend binds one OpenMP thread per listed core; unset it uses fewer.
           "VLLM_CPU_OMP_THREADS_BIND": cpu_ranges(usable_cpus()),
           "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB)}
    argv = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL_NAME, "--dtype", dtype, "--host", HOST, "--port", str(port),
            "--no-enable-prefix-caching", "--max-model-len", str(max_model_len)]
    return Server("vllm", argv, env, f"http://{HOST}:{port}", workdir / "vllm.log")


# ---------------------------------------------------------------- the load (own client)


def run_aiperf(server: Server, args: argparse.Namespace, tokenizer_dir: Path, workdir: Path) -> dict:
    """The same load sent by aiperf 0.13 (.peers/aiperf), its own synthetic prompts; its figures.
    PeerUnavailable when aiperf fails. It runs in a session of its own too: it starts processes."""
    artifacts = workdir / f"aiperf-{server.name}"
    extra = {"min_tokens": args.output_tokens, "ignore_eos": True}
    argv = [str(AIPERF), "profile", "--model", MODEL_NAME, "--url", server.url, "--endpoint-type", "chat",
            "--streaming", "--tokenizer", str(tokenizer_dir), "--random-seed", str(SEED),
            "--prompt-input-tokens-mean", str(args.prompt_tokens), "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(args.output_tokens), "--prompt-output-tokens-stddev", "0",
            "--use-legacy-max-tokens", "--use-server-token-count", "--extra-inputs", json.dumps(extra),
            "--concurrency", str(args.concurrency), "--request-count", str(args.requests),
            # one synthetic prompt per request, each used once (shuffled, without replacement)
            "--num-dataset-entries", str(args.requests), "--dataset-sampling-strategy", "shuffle",
            "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry", "--artifact-dir", str(artifacts)]
    if args.aiperf_rate:   # a new request at most every 1/rate s while a slot is free: no timing loop spinning
        argv += ["--request-rate", str(args.aiperf_rate), "--arrival-pattern", "constant"]
    client = Server(f"aiperf-{server.name}", argv, dict(os.environ), "", workdir / f"aiperf-{server.name}.log")
    try:
        client.start()
        returncode = client.process.wait(REQUEST_TIMEOUT_S * 2)
    except subprocess.TimeoutExpired:
        returncode = None
    finally:
        client.stop()
    if returncode != 0:
        raise PeerUnavailable(f"aiperf failed ({returncode}): {log_tail(client.log_path, 8)}")
    metrics = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    name = server.name
    num_errors = int(metrics.get("error_request_count", {}).get("avg", 0))
    return {f"{name}_requests": int(metrics["request_count"]["avg"]) + num_errors, f"{name}_errors": num_errors,
            f"{name}_wrong_lengths": int(metrics.get("osl_mismatch_count", {}).get("avg", 0)),
            f"{name}_output_tok_s": round(metrics["output_token_throughput"]["avg"], 2),
            f"{name}_prompt_cached_pct": round(metrics.get("overall_usage_prompt_cache_read_pct", {}).get("avg", 0), 2),
            f"{name}_ttft_ms_p50": round(metrics["time_to_first_token"]["p50"], 2),
            f"{name}_ttft_ms_p99": round(metrics["time_to_first_token"]["p99"], 2),
            f"{name}_itl_ms_mean": round(metrics["inter_token_latency"]["avg"], 3),
            f"{name}_itl_ms_p50": round(metrics["inter_token_latency"]["p50"], 3)}


# ---------------------------------------------------------------- the run


@dataclass(frozen=True)
class Load:
    """What every server gets: the flags, the timed prompts, the warm-up prompts."""

    args: argparse.Namespace
    prompts: list[str]
    warmup: list[str]
    model_dir: Path
    workdir: Path


def measure(server: Server, load: Load, start_timeout_s: float) -> dict:
    """Start ``server``, warm it up, time the load, stop it. PeerUnavailable when it does not
    come up or fails every warm-up request."""
    args = load.args
    try:
        server.start()
        began = time.monotonic()
        server.wait_ready(start_timeout_s)
        log(f"{server.name}: up in {time.monotonic() - began:.0f} s at {server.url}; warming up")
        samples, _ = asyncio.run(run_load(server.url, load.warmup, args.concurrency, args.output_tokens))
        if all(s.error for s in samples):
            raise PeerUnavailable(f"{server.name} failed every warm-up request, e.g. {samples[0].error}")
        log(f"{server.name}: {len(load.prompts)} requests, {args.concurrency} at a time ({args.client} client)")
        load_avg = os.getloadavg()[0]   # what else runs on these cores: the figures' caveat
        if args.client == "aiperf":
            result = run_aiperf(server, args, load.model_dir, load.workdir)
        else:
            samples, wall_s = asyncio.run(run_load(server.url, load.prompts, args.concurrency, args.output_tokens))
            result = figures(server.name, samples, wall_s, args.output_tokens)
    finally:
        began = time.monotonic()
        num_left = server.stop()
        log(f"{server.name}: stopped in {time.monotonic() - began:.0f} s, {num_left} of its processes left")
    result.update({f"{server.name}_processes_left": num_left, f"{server.name}_load_avg_1m": round(load_avg, 2)})
    log(f"{server.name}: {json.dumps(result)}")
    return result


def ratios(result: dict) -> dict:
    def over(key: str) -> float | None:
        epd, vllm = result.get(f"epd_{key}"), result.get(f"vllm_{key}")
        return round(epd / vllm, 4) if epd is not None and vllm else None

    return {"throughput_vs_vllm": over("output_tok_s"), "ttft_p99_vs_vllm": over("ttft_ms_p99"),
            "itl_vs_vllm": over("itl_ms_mean")}


COUNTS = ("requests", "errors", "wrong_lengths", "processes_left")
"""Per-server figures summed over the repeats (the rest are each repeat's median)."""


def combine(runs: list[dict]) -> dict:
    """One server's repeats as one: counts summed, every other figure the repeats' median."""
    combined = {}
    for key in runs[0]:
        values = [run[key] for run in runs if run.get(key) is not None]
        if key.split("_", 1)[1] in COUNTS:
            combined[key] = sum(values)
        else:
            combined[key] = round(statistics.median(values), 3) if values else None
    return combined


def run(args: argparse.Namespace, workdir: Path) -> dict:
    """Each repeat starts each server afresh (its own directory: logs, a new KV store) and runs
    the same load; even repeats epd first, odd ones vLLM first, so a machine that speeds up or
    slows down through the run hits both alike."""
    from services.engine.models.loader import resolve_model_dir  # torch: the model's directory, once

    model_dir = resolve_model_dir(None)[0]
    prompts = make_prompts(model_dir, args.requests + args.concurrency, args.prompt_tokens, SEED)
    result = {"requests": args.requests, "concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens,
              "output_tokens": args.output_tokens, "client": args.client, "cpus": len(usable_cpus()),
              "dtype": args.dtype, "epd_args": args.epd_args, "repeats": args.repeats, "aiperf_rate": args.aiperf_rate,
              "cpu": cpu_info()}
    runs: dict[str, list[dict]] = {"epd": [], "vllm": []}
    if args.no_vllm:
        result["vllm_absent"] = "--no-vllm"
    for repeat in range(args.repeats):
        rundir = workdir / f"run{repeat}"
        rundir.mkdir()
        load = Load(args, prompts[:args.requests], prompts[args.requests:], model_dir, rundir)
        for name in ("epd", "vllm") if repeat % 2 == 0 else ("vllm", "epd"):
            if name == "epd":
                try:
                    runs["epd"].append(measure(epd_server(rundir, args.dtype, args.epd_args), load,
                                               EPD_START_TIMEOUT_S))
                except PeerUnavailable as exc:   # ours not coming up is a failure, not an absent column
                    raise SystemExit(f"epd: {exc}") from None
            elif "vllm_absent" not in result:
                try:
                    max_model_len = max(2048, args.prompt_tokens + args.output_tokens + 128)
                    server = vllm_server(rundir, model_dir, args.dtype, max_model_len)
                    runs["vllm"].append(measure(server, load, VLLM_START_TIMEOUT_S))
                    result["vllm_version"] = vllm_version()
                except PeerUnavailable as exc:
                    log(f"vllm: absent: {exc}")
                    result["vllm_absent"] = str(exc)
                    runs["vllm"] = []
    result.update(summarize(runs))
    return result


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Each server's runs combined, the ratios of those, and with more than one repeat of both,
    each repeat's own ratios (``..._runs``): ahead in every pair or not."""
    result = {}
    for server_runs in runs.values():
        if server_runs:
            result.update(combine(server_runs))
    result.update(ratios(result))
    if len(runs["vllm"]) == len(runs["epd"]) > 1:
        pairs = [ratios({**epd, **vllm}) for epd, vllm in zip(runs["epd"], runs["vllm"])]
        result.update({f"{key}_runs": [pair[key] for pair in pairs] for key in pairs[0]})
    return result


def vllm_version() -> str:
    found = sorted((VLLM_VENV / "lib").glob("python3*/site-packages/vllm*.dist-info"))
    return found[0].name.removesuffix(".dist-info").split("-", 1)[1] if found else "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48, help="timed requests per server")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (also the warm-up's count)")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="user-content tokens of every prompt")
    parser.add_argument("--output-tokens", type=int, default=64, help="tokens every request gives (EOS ignored)")
    parser.add_argument("--no-vllm", action="store_true", help="epd only; vLLM reported absent")
    parser.add_argument("--client", choices=("auto", "own", "aiperf"), default="auto",
                        help="the load client: aiperf 0.13 from .peers/aiperf, or this file's; auto: aiperf "
                             "where it is installed")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="both servers' precision (epd up's own default, auto, is bf16 on CPUs with native bf16)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each server, the order alternating; figures are the medians")
    parser.add_argument("--epd-args", default="", help="extra flags for epd up, e.g. '--prefills 2'")
    parser.add_argument("--quick", action="store_true", help="a tiny load (8 requests of 64 + 16 tokens, 4 at a time)")
    parser.add_argument("--aiperf-rate", type=float, metavar="R",
                        help="aiperf paces its requests at R per second, still --concurrency at most in flight; "
                             "unset, its concurrency mode, whose timing loop polls without pause")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="run in DIR (new or empty) and keep it: the servers' logs, aiperf's per-request records")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency, args.prompt_tokens, args.output_tokens = 8, 4, 64, 16
    if min(args.requests, args.concurrency, args.prompt_tokens, args.output_tokens, args.repeats) < 1:
        parser.error("--requests, --concurrency, --prompt-tokens, --output-tokens and --repeats must be >= 1")
    if args.client == "auto":
        args.client = "aiperf" if AIPERF.exists() else "own"
    if args.client == "aiperf" and not AIPERF.exists():
        parser.error(f"--client aiperf needs {AIPERF}: make bench-peers installs it")
    if args.aiperf_rate is not None and (args.client != "aiperf" or not 0 < args.aiperf_rate < float("inf")):
        parser.error("--aiperf-rate paces the aiperf client: a finite rate > 0, with aiperf as the client")
    if args.keep and args.keep.exists() and (not args.keep.is_dir() or any(args.keep.iterdir())):
        parser.error(f"--keep {args.keep}: not an empty directory")
    # SIGTERM unwinds like Ctrl-C, so the servers are stopped either way.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            result = run(args, args.keep.resolve())
        else:
            with tempfile.TemporaryDirectory(prefix="serving-bench-") as tmp:
                result = run(args, Path(tmp))
    except KeyboardInterrupt:   # the servers are stopped by now
        raise SystemExit("interrupted") from None
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
