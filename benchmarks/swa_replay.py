"""Sliding-window prefix hits: TTFT of one long prompt on a hybrid model, hit, replay and cold.

A hybrid model (sliding-window layers between full-attention ones) keeps two KV pools: the
full-attention one holds every block of a prompt, the window one only each sequence's window, and
is small, so other traffic soon evicts it. A prefix hit then has three cases, all measured here in
one ``LLMEngine`` stepped by hand:

- ``hit``: the prompt's full-attention and window blocks are both still cached: it starts at
  L1 = the block-aligned prefix (at most len - 1 tokens) and computes only the rest;
- ``replay``: the full-attention blocks are cached but the window's were evicted (by other random
  prompts run in between, enough to cycle the window pool): a bounded replay restarts at
  L1 - ModelConfig.replay_tokens (rounded down to a block) and recomputes only those tokens;
- ``cold``: nothing cached (an engine with prefix caching off): the whole prompt is computed.

TTFT is the seconds from ``add_request`` to the step that returns the first token (greedy,
max_tokens=1, ignore_eos). ``num_cached_tokens`` is checked in every run (L1 for the hit, the
replay start for the replay, 0 cold): a run that is not the case it claims fails loudly. The first
token must be the same in all three cases (``outputs_identical``). Each round runs the cases in
alternating order (cold first, then hit and replay; or replay, hit, then cold), each from a fresh
caching engine, so other load on the machine hits them alike; figures are medians over rounds.

The model: random weights saved as a Qwen2 model directory in a temp dir, SmolLM2-135M's widths
(hidden 576, 9 heads, 3 KV heads, intermediate 1536) so per-token costs are those of a real small
model on a CPU, but 12 layers alternating sliding and full attention as GPT-OSS does (window 128)
and a 2,048-token vocabulary, to keep a CPU run of an 8k prompt within minutes. replay_tokens is
then 6 * 127 = 762, about a tenth of the prompt: the goal is replay TTFT <= 0.2 of cold. Block
size 16, fp32 on the CPU.

Last line, JSON: ``replay_vs_cold`` (median replay TTFT / median cold TTFT; goal <= 0.2),
``hit_vs_cold``, the median TTFTs, ``tokens_computed`` per case (prompt tokens minus cached),
``replay_tokens``, ``outputs_identical`` and ``meets_goal``.

    .venv/bin/python benchmarks/swa_replay.py [--prompt-tokens 8192] [--rounds 3]
    .venv/bin/python benchmarks/swa_replay.py --quick     # tiny model, 512 tokens, 1 round: a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.engine import LLMEngine  # noqa: E402
from services.engine.kv_groups import num_window_blocks  # noqa: E402
from services.engine.models.loader import load_model  # noqa: E402
from tests.factories import make_tiny_model_dir, random_prompts  # noqa: E402

B = 16
GOAL = 0.2
CASES = ("cold", "hit", "replay")
SMOL = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
            vocab_size=2048, num_hidden_layers=12, sliding_window=128, rope_theta=100000.0)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=512, num_hidden_layers=4, sliding_window=32, rope_theta=10000.0)


def make_model(path: Path, dims: dict, max_len: int) -> Path:
    layers = dims["num_hidden_layers"]
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return make_tiny_model_dir(path, "qwen2", seed=0, use_sliding_window=True, layer_types=types,
                               max_position_embeddings=max_len, **dims)


def ttft(eng: LLMEngine, prompt: list[int]) -> tuple[float, int, int]:
    """(seconds to the first token, num_cached_tokens, the first token) of one greedy request."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    request_id = eng.add_request(prompt, params)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == request_id and out.token_ids:
                seconds = time.perf_counter() - start
                while eng.has_unfinished_requests():  # nothing else runs; let it finish
                    eng.step()
                return seconds, out.num_cached_tokens, out.token_ids[0]
    raise RuntimeError("the request finished without a token")


def drain(eng: LLMEngine, prompts: list[list[int]]) -> None:
    for prompt in prompts:
        eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=1024, help="max_num_batched_tokens (prefill chunk)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 512-token prompt, 1 round")
    args = parser.parse_args(argv)
    dims = SMOL
    if args.quick:
        dims, args.prompt_tokens, args.rounds, args.chunk = TINY, 512, 1, 128
    n = args.prompt_tokens
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(str(make_model(Path(tmp) / "hybrid", dims, max_len=2 * n + 1024)))
    cfg = loaded.config
    prompt = random_prompts(1, [n], vocab=cfg.vocab_size, seed=1)[0]
    l1 = (n - 1) // B * B
    expected = {"cold": 0, "hit": l1, "replay": max(0, l1 - cfg.replay_tokens) // B * B}
    assert 0 < expected["replay"] < l1, f"the prompt ({n}) is too short for a replay of {cfg.replay_tokens}"

    def engine(caching: bool) -> LLMEngine:
        # The full-attention pool holds the prompt and the eviction traffic with room to spare.
        blocks = 2 * (n // B) + 256
        return LLMEngine(EngineConfig(block_size=B, num_kv_blocks=blocks, max_num_seqs=1,
                                      max_num_batched_tokens=args.chunk, enable_prefix_caching=caching,
                                      device="cpu", dtype="float32"), loaded)

    cold_engine = engine(False)
    window_blocks = num_window_blocks(cfg.sliding_window, B, 1, args.chunk)
    # The window pool's size and a few blocks more, in two prompts: every window block is reused.
    traffic_len = (window_blocks // 2 + 4) * B
    drain(cold_engine, random_prompts(1, [min(n, 512)], vocab=cfg.vocab_size, seed=2))  # warm-up

    times: dict[str, list[float]] = {case: [] for case in CASES}
    firsts: dict[str, set[int]] = {case: set() for case in CASES}
    for r in range(args.rounds):
        eng = engine(True)
        assert eng.kv.managers[1].num_blocks == window_blocks, (eng.kv.managers[1].num_blocks, window_blocks)
        traffic = random_prompts(2, [traffic_len, traffic_len], vocab=cfg.vocab_size, seed=100 + r)

        def run(case: str) -> None:
            seconds, cached, first = ttft(cold_engine if case == "cold" else eng, prompt)
            if cached != expected[case]:
                raise AssertionError(f"round {r}, {case}: num_cached_tokens {cached}, expected {expected[case]}")
            times[case].append(seconds)
            firsts[case].add(first)
            print(f"round {r} {case:>6}: {seconds:7.3f} s, {n - cached} tokens computed", file=sys.stderr)

        _, cached, first = ttft(eng, prompt)  # fills both pools (untimed)
        assert cached == 0
        firsts["cold"].add(first)
        if r % 2 == 0:
            run("cold")
            run("hit")
            drain(eng, traffic)
            run("replay")
        else:
            drain(eng, traffic)
            run("replay")
            run("hit")  # the replay rebuilt the window blocks: a full hit again
            run("cold")

    med = {case: statistics.median(times[case]) for case in CASES}
    replay_vs_cold = med["replay"] / med["cold"]
    result = {
        "replay_vs_cold": round(replay_vs_cold, 4),
        "hit_vs_cold": round(med["hit"] / med["cold"], 4),
        "ttft_cold_s": round(med["cold"], 4),
        "ttft_replay_s": round(med["replay"], 4),
        "ttft_hit_s": round(med["hit"], 4),
        "tokens_computed": {case: n - expected[case] for case in CASES},
        "replay_tokens": cfg.replay_tokens,
        "prompt_tokens": n,
        "window": cfg.sliding_window,
        "layers": cfg.num_layers,
        "sliding_layers": len(cfg.kv_groups[1]),
        "hidden_size": cfg.hidden_size,
        "window_pool_blocks": window_blocks,
        "max_num_batched_tokens": args.chunk,
        "rounds": args.rounds,
        "outputs_identical": len(set().union(*firsts.values())) == 1,
        "goal_replay_vs_cold": GOAL,
        "meets_goal": replay_vs_cold <= GOAL,
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
