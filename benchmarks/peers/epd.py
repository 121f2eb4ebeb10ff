"""Our engine as a benchmark column in a process of its own, as every peer runs: one LLM, loaded
once, one LLM.generate batch per call.

Each column then starts from the same place: a fresh process holding only its own engine. Run in
the benchmark's process, ours stepped beside everything the benchmark had loaded by then (both
transformers columns, the batch-invariant and bf16 engines: ~10 GB) and moved 35-43 s between
repeats of one run where each peer, alone in its process, moved 37-39 s.

    python -m benchmarks.peers.epd '{"max_num_batched_tokens": 2048, ...}'   # LLM(**args)

prints {"ready": true, "vocab_size": ...}, then answers each stdin line {"prompts": [[token
ids]...], "max_tokens": N} with {"seconds": ..., "token_ids": [[...]...]}: greedy, no EOS stop,
the batch timed alone.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from benchmarks.peers.driver import LineDriver

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600.0
BATCH_TIMEOUT_S = 1800.0


class Epd:
    def __init__(self, log_name: str = "epd.log", model: str | None = None, **engine_args) -> None:
        """``LLM(model, **engine_args)`` in its own process (None: the default model); raises
        PeerUnavailable when it does not load (the reason is in its log)."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        argv = [sys.executable, "-m", "benchmarks.peers.epd", json.dumps({"model": model, **engine_args})]
        self.driver = LineDriver("epd", argv, log_name, START_TIMEOUT_S, env)
        self.vocab_size: int = self.driver.hello["vocab_size"]

    def run(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        reply = self.driver.ask({"prompts": prompts, "max_tokens": output_len}, BATCH_TIMEOUT_S)
        return reply["seconds"], reply["token_ids"]

    def close(self) -> None:
        self.driver.close()


def main() -> None:
    from services.engine import LLM, SamplingParams

    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # only the replies on stdout
    llm = LLM(**json.loads(sys.argv[1]))
    print(json.dumps({"ready": True, "vocab_size": llm.engine.model_config.vocab_size}), file=replies)
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(temperature=0, max_tokens=request["max_tokens"], ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(request["prompts"], params)
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "token_ids": [o.token_ids for o in outputs]}), file=replies)


if __name__ == "__main__":
    main()
