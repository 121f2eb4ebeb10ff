"""llama.cpp as a benchmark column: llama-server started once, prompts sent concurrently.

One server per precision, with one slot per prompt (``--parallel``), so every prompt is in flight
at once, as in one offline batch. Each slot has its own KV (not ``--kv-unified``: with one pool
shared by 32 sequences every decode attends over all of their cells, masked, which made the
32-prompt batch ~6x slower than this). The KV cache is kept in the weights'
precision (f32 / bf16) rather than llama.cpp's default f16, like ours. Each prompt goes as token
ids to /completion: greedy (temperature 0), n_predict tokens, no EOS stop, no prompt cache.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from benchmarks.peers import LOG_DIR, PEERS_DIR, PeerUnavailable, log_tail, start_process, stop_group, usable_cpus

SERVER = PEERS_DIR / "llama-server"
MODELS = {"float32": PEERS_DIR / "models" / "smollm2-135m-f32.gguf",
          "bfloat16": PEERS_DIR / "models" / "smollm2-135m-bf16.gguf"}
CACHE_TYPES = {"float32": "f32", "bfloat16": "bf16"}
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 1800.0


def server_version() -> str | None:
    """`llama-server --version`'s "version: N (commit)", or None when it is not built."""
    if not SERVER.exists():
        return None
    done = subprocess.run([str(SERVER), "--version"], capture_output=True, text=True, timeout=30)
    return next((line.removeprefix("version: ") for line in (done.stdout + done.stderr).splitlines()
                 if line.startswith("version:")), "unknown")


class LlamaCpp:
    def __init__(self, dtype: str, max_num_batched_tokens: int, num_slots: int, slot_tokens: int) -> None:
        """``slot_tokens``: each slot's context, sized by the caller to its longest prompt and output,
        and no more: the machine's memory is shared. Raises PeerUnavailable when the server or the
        model is missing or does not come up."""
        for path in (SERVER, MODELS[dtype]):
            if not path.exists():
                raise PeerUnavailable(f"{path} missing: run `make bench-peers`")
        self.version = server_version()
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"llama_cpp-{dtype}.log"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        num_threads = str(len(usable_cpus()))
        with open(self.log_path, "w") as log:
            self.process = start_process(
                [str(SERVER), "--model", str(MODELS[dtype]), "--host", "127.0.0.1", "--port", str(port),
                 "--parallel", str(num_slots), "--no-kv-unified", "--ctx-size", str(num_slots * slot_tokens),
                 "--batch-size", str(max_num_batched_tokens), "--threads", num_threads,
                 "--threads-batch", num_threads, "--cache-type-k", CACHE_TYPES[dtype],
                 "--cache-type-v", CACHE_TYPES[dtype], "--cache-ram", "0", "--no-webui"],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy()
        except BaseException:  # not up, or Ctrl-C / SIGTERM while it loads
            self.close()
            raise

    def run(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        pool = ThreadPoolExecutor(max_workers=len(prompts))
        try:
            start = time.perf_counter()
            replies = list(pool.map(lambda p: self._complete(p, output_len), prompts))
            seconds = time.perf_counter() - start
        finally:  # on Ctrl-C, no wait for requests in flight: close() stops the server under them
            pool.shutdown(wait=False, cancel_futures=True)
        return seconds, [r["tokens"] for r in replies]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        stop_group(self.process, 10)

    def _complete(self, prompt: list[int], output_len: int) -> dict:
        body = json.dumps({"prompt": prompt, "n_predict": output_len, "temperature": 0, "ignore_eos": True,
                           "cache_prompt": False, "return_tokens": True, "stream": False}).encode()
        request = urllib.request.Request(f"{self.url}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return json.load(response)
        except (OSError, ValueError) as exc:
            raise PeerUnavailable(f"llama-server /completion failed: {exc!r} (log {self.log_path})") from exc

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PeerUnavailable(f"llama-server exited with {self.process.returncode}: "
                                      f"{log_tail(self.log_path, 5)}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass  # 503 (HTTPError) while the model loads, refused before it listens
            time.sleep(0.2)
        raise PeerUnavailable(f"llama-server not healthy within {START_TIMEOUT_S:.0f} s (log {self.log_path})")
