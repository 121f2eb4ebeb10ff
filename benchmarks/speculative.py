"""Speculative decoding (n-gram prompt lookup): decode tokens per second with and without it.

SmolLM2-135M-Instruct, greedy, one request at a time (where decode is bound by reading the
weights once per step, and a verified draft is nearly free), on two workloads:

- ``repetitive``: "repeat this code with one change" chats, whose answers copy the prompt (and
  the model's own earlier lines);
- ``free``: open-ended chats (stories, explanations), where n-gram matches are rare and mostly
  wrong: what speculation must not slow down.

Each round runs every prompt of a workload on the plain engine and on the speculative one, in
alternating order (other load on the machine hits both alike); decode seconds are from a
request's first token to its last, so prefill is left out. The outputs of the two engines are
compared token for token (greedy: they must be equal).

Last line, JSON: ``repetitive_speedup`` (goal >= 1.5) and ``free_speedup`` (goal >= 0.95), the
median over rounds of speculative over plain decode tok/s; the tok/s themselves, the acceptance
rate of each workload (accepted drafts / drafts), and ``outputs_identical``.

    .venv/bin/python benchmarks/speculative.py [--rounds 3] [--max-tokens 160] [--k 5]
    .venv/bin/python benchmarks/speculative.py --quick     # 1 round, short answers: a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine import LLM, SamplingParams  # noqa: E402

CODE = [
    '''def merge_sorted(a, b):
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    result.extend(a[i:])
    result.extend(b[j:])
    return result
''',
    '''class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1

    def most_common(self, n):
        items = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)
        return items[:n]
''',
    '''function debounce(fn, delay) {
  let timer = null;
  return function (...args) {
    clearTimeout(timer);
    timer = setTimeout(() => fn.apply(this, args), delay);
  };
}
''',
    '''SELECT customers.name, COUNT(orders.id) AS num_orders
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2024-01-01'
GROUP BY customers.name
ORDER BY num_orders DESC
LIMIT 10;
''',
]
CHANGES = ["rename the function to merge_lists", "rename the class to Tally",
           "rename the function to throttle", "change the limit to 20"]
FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three ideas for a weekend trip in the mountains, with a sentence on each.",
    "Describe the taste of a ripe mango to someone who has never had one.",
]


def workloads(quick: bool) -> dict[str, list[list[dict]]]:
    repetitive = [[{"role": "user", "content": f"Repeat this code exactly, but {change}:\n\n{code}"}]
                  for code, change in zip(CODE, CHANGES)]
    free = [[{"role": "user", "content": text}] for text in FREE]
    return {"repetitive": repetitive[:1] if quick else repetitive, "free": free[:1] if quick else free}


def decode_run(llm: LLM, conversation: list[dict], params: SamplingParams) -> tuple[list[int], float]:
    """The greedy answer's tokens and the seconds from its first token to its last."""
    engine = llm.engine
    prompt = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    request_id = engine.add_request(prompt, params)
    first = last = None
    token_ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            token_ids = list(out.token_ids)
    return token_ids, last - first


def measure(llms: dict[str, LLM], chats: list[list[dict]], params: SamplingParams, rounds: int) -> dict:
    speeds: dict[str, list[float]] = {name: [] for name in llms}
    outputs: dict[str, list[list[int]]] = {name: [] for name in llms}
    spec = llms["spec"].engine
    drafted, accepted = spec.num_draft_tokens, spec.num_accepted_tokens
    for r in range(rounds):
        tokens = {name: 0 for name in llms}
        seconds = {name: 0.0 for name in llms}
        for i, chat in enumerate(chats):
            order = list(llms) if (r + i) % 2 == 0 else list(reversed(llms))
            for name in order:
                token_ids, s = decode_run(llms[name], chat, params)
                tokens[name] += len(token_ids) - 1
                seconds[name] += s
                if r == 0:
                    outputs[name].append(token_ids)
        for name in llms:
            speeds[name].append(tokens[name] / seconds[name])
    ratios = [s / p for s, p in zip(speeds["spec"], speeds["plain"])]
    num_drafted = spec.num_draft_tokens - drafted
    return {"plain_tok_s": round(statistics.median(speeds["plain"]), 2),
            "spec_tok_s": round(statistics.median(speeds["spec"]), 2),
            "speedup": round(statistics.median(ratios), 3),
            "acceptance": round((spec.num_accepted_tokens - accepted) / num_drafted, 3) if num_drafted else 0.0,
            "identical": outputs["plain"] == outputs["spec"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens (the most drafts per step)")
    parser.add_argument("--quick", action="store_true", help="1 round, 24 tokens, one prompt per workload")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.max_tokens = 1, 24
    spec_config = json.dumps({"method": "ngram", "num_speculative_tokens": args.k,
                              "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    llms = {"plain": LLM(None, kv_cache_gib=0.25),
            "spec": LLM(None, kv_cache_gib=0.25, speculative_config=spec_config)}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    warm = workloads(True)["free"][0]
    for llm in llms.values():  # first steps warm up kernels and caches
        decode_run(llm, warm, SamplingParams(temperature=0, max_tokens=8))
    result: dict = {}
    for name, chats in workloads(args.quick).items():
        figures = measure(llms, chats, params, args.rounds)
        print(f"{name:>10}: plain {figures['plain_tok_s']:6.1f} tok/s, speculative {figures['spec_tok_s']:6.1f} "
              f"tok/s ({figures['speedup']:.2f}x), acceptance {figures['acceptance']:.2f}, "
              f"identical {figures['identical']}", file=sys.stderr)
        result.update({f"{name}_{key}": value for key, value in figures.items()})
    result["repetitive_speedup"] = result.pop("repetitive_speedup")
    result["free_speedup"] = result.pop("free_speedup")
    result.update(outputs_identical=result["repetitive_identical"] and result["free_identical"],
                  goal_repetitive_met=result["repetitive_speedup"] >= 1.5,
                  goal_free_met=result["free_speedup"] >= 0.95,
                  rounds=args.rounds, max_tokens=args.max_tokens, num_speculative_tokens=args.k, batch=1)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
