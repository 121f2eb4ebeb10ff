"""Offline throughput: our LLM.generate vs transformers' batched generate, same run, same weights.

32 prompts of mixed length (50-1,000 tokens), 64 greedy output tokens each, SmolLM2-135M-Instruct
(fp32 on the CPU). transformers runs one padded batch (left padding), the way its users batch
offline; we run continuous batching with chunked prefill. Both produce the same number of tokens.
Last line: JSON with ours_tok_s, hf_tok_s, ratio (goal: ratio >= 3).

    python benchmarks/engine_throughput.py [--num-prompts 32] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine import LLM, SamplingParams  # noqa: E402


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the low ids: SmolLM2 keeps its special tokens there.
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_ours(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.token_ids for o in outs]


def run_hf(model, prompts: list[list[int]], output_len: int, pad_id: int) -> tuple[float, list[list[int]]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - start, out[:, width:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=50)
    parser.add_argument("--max-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()

    import transformers

    llm = LLM(None, max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_gib=2.0,
              enable_prefix_caching=False)
    from services.engine.models.loader import load_model
    hf = transformers.LlamaForCausalLM.from_pretrained(load_model(None).path, torch_dtype=torch.float32).eval()
    vocab = llm.engine.model_config.vocab_size
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, vocab)
    num_tokens = args.num_prompts * args.output_len
    print(f"{args.num_prompts} prompts, {sum(map(len, prompts))} prompt tokens "
          f"({min(map(len, prompts))}-{max(map(len, prompts))}), {args.output_len} output tokens each, "
          f"torch threads {torch.get_num_threads()}", file=sys.stderr)

    warm = make_prompts(4, 20, 60, vocab, seed=1)  # first-call costs out of the timings
    run_ours(llm, warm, 4)
    run_hf(hf, warm, 4, pad_id=2)

    ours_s, ours_ids = run_ours(llm, prompts, args.output_len)
    print(f"ours: {ours_s:.2f} s, {num_tokens / ours_s:.1f} tok/s", file=sys.stderr)
    hf_s, hf_ids = run_hf(hf, prompts, args.output_len, pad_id=2)
    print(f"transformers: {hf_s:.2f} s, {num_tokens / hf_s:.1f} tok/s", file=sys.stderr)
    same = sum(a == b for a, b in zip(ours_ids, hf_ids))
    print(json.dumps({
        "ours_tok_s": round(num_tokens / ours_s, 2),
        "hf_tok_s": round(num_tokens / hf_s, 2),
        "ratio": round(hf_s / ours_s, 3),
        "ours_s": round(ours_s, 3),
        "hf_s": round(hf_s, 3),
        "identical_outputs": f"{same}/{len(prompts)}",
    }))


if __name__ == "__main__":
    main()
