"""vLLM's CPU build as a benchmark column: vllm_offline.py in its own venv, loaded once."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from pathlib import Path

from benchmarks.peers import (LOG_DIR, PEERS_DIR, PeerUnavailable, cpu_ranges, log_tail, start_process, stop_group,
                             usable_cpus)

VENV = PEERS_DIR / "vllm"
READY_STAMP = VENV / ".ready"
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
        """Raises PeerUnavailable when .peers/vllm is not installed or the driver does not come up."""
        if not READY_STAMP.exists():
            raise PeerUnavailable(f"{READY_STAMP} missing: run `make bench-peers`")
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"vllm_cpu-{dtype}.log"
        env = {**os.environ,
               # vLLM's CPU backend binds one OpenMP thread per listed core; unset it uses fewer.
               "VLLM_CPU_OMP_THREADS_BIND": cpu_ranges(usable_cpus()),
               "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}
        if IOMP.exists():  # vLLM's CPU install guide preloads Intel's OpenMP (vllm-cpu ships it)
            env["LD_PRELOAD"] = ":".join(filter(None, [str(IOMP), os.environ.get("LD_PRELOAD")]))
        with open(self.log_path, "w") as log:
            self.process = start_process(
                [str(VENV / "bin" / "python"), str(DRIVER), "--model", str(model_dir), "--dtype", dtype,
                 "--max-num-batched-tokens", str(max_num_batched_tokens)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
        self._unread = b""
        self._busy = True
        """Loading or running a batch, so not reading its stdin: close() does not wait for it."""
        try:
            self.version = self._reply(START_TIMEOUT_S)["version"]
        except BaseException:  # not up, or Ctrl-C / SIGTERM while it loads
            self.close()
            raise
        self._busy = False

    def run(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        self._busy = True
        self.process.stdin.write(json.dumps({"prompts": prompts, "max_tokens": output_len}).encode() + b"\n")
        self.process.stdin.flush()
        reply = self._reply(BATCH_TIMEOUT_S)
        self._busy = False
        return reply["seconds"], reply["token_ids"]

    def close(self) -> None:
        """Asks the driver to exit (end of its stdin), then stops its whole group: at once when it is
        busy (Ctrl-C or SIGTERM in the middle of a batch), else after a grace period."""
        if not self.process.stdin.closed:
            try:
                self.process.stdin.close()
            except BrokenPipeError:  # it already exited with bytes unread
                pass
        stop_group(self.process, 0 if self._busy else 30)

    def _reply(self, timeout_s: float) -> dict:
        """The driver's next line. Raw reads (not readline) so select never waits on bytes that a
        buffered reader already holds."""
        deadline = time.monotonic() + timeout_s
        fd = self.process.stdout.fileno()
        while b"\n" not in self._unread:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise PeerUnavailable(f"vLLM gave no answer within {timeout_s:.0f} s (log {self.log_path})")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise PeerUnavailable(f"vLLM exited with {self.process.wait()}: {log_tail(self.log_path, 5)}")
            self._unread += chunk
        line, _, self._unread = self._unread.partition(b"\n")
        return json.loads(line)

