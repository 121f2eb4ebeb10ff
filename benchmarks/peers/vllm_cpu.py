"""vLLM's CPU build as a benchmark column: vllm_offline.py in its own venv, loaded once."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.peers import VLLM_READY, VLLM_VENV, PeerUnavailable, cpu_ranges, usable_cpus
from benchmarks.peers.driver import LineDriver

VENV = VLLM_VENV
READY_STAMP = VLLM_READY
DRIVER = Path(__file__).with_name("vllm_offline.py")
IOMP = VENV / "lib" / "libiomp5.so"
START_TIMEOUT_S = 900.0
"""Loading plus vLLM's CPU set-up on two busy cores has taken minutes."""
BATCH_TIMEOUT_S = 1800.0
"""The first batch also compiles; a full 32-prompt batch in fp32 on two cores is well under this."""
KV_CACHE_GIB = 1
"""Whole GiB only (VLLM_CPU_KVCACHE_SPACE); 1 holds 23k fp32 tokens, the 32 prompts and their
outputs need ~20k: 2 (ours) would leave two vLLM processes and ours short of this machine's memory."""


class VllmCpu:
    def __init__(self, model_dir: Path, dtype: str, max_num_batched_tokens: int) -> None:
        """Raises PeerUnavailable when .venv-vllm is not installed or the driver does not come up."""
        if not READY_STAMP.exists():
            raise PeerUnavailable(f"{READY_STAMP} missing: run `make setup-vllm`")
        env = {**os.environ,
               # vLLM's CPU backend binds one OpenMP thread per listed core; unset it uses fewer.
               "VLLM_CPU_OMP_THREADS_BIND": cpu_ranges(usable_cpus()),
               "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}
        if IOMP.exists():  # vLLM's CPU install guide preloads Intel's OpenMP (vllm-cpu ships it)
            env["LD_PRELOAD"] = ":".join(filter(None, [str(IOMP), os.environ.get("LD_PRELOAD")]))
        self.driver = LineDriver(
            "vLLM", [str(VENV / "bin" / "python"), str(DRIVER), "--model", str(model_dir), "--dtype", dtype,
                     "--max-num-batched-tokens", str(max_num_batched_tokens)],
            f"vllm_cpu-{dtype}.log", START_TIMEOUT_S, env)
        self.version = self.driver.hello["version"]

    def run(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        reply = self.driver.ask({"prompts": prompts, "max_tokens": output_len}, BATCH_TIMEOUT_S)
        return reply["seconds"], reply["token_ids"]

    def close(self) -> None:
        self.driver.close()
