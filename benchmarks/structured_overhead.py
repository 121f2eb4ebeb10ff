"""What structured output costs: decoding constrained by a JSON schema vs. free, same run.

SmolLM2-135M-Instruct (fp32 on the CPU), one chat prompt asking for JSON, a batch of B
concurrent requests (fixed seeds, temperature 0.8) decoding max_tokens each: free (ignore_eos,
so every request runs to max_tokens) vs. constrained by a non-trivial JSON schema (nested
objects, enums, arrays, patterns) whose documents are longer than max_tokens, so constrained
requests also run to max_tokens (finish_reason "length") and both sides produce the same
number of tokens. Free and constrained runs alternate (--repeats of each) so load from other
processes hits both alike; one warm-up run of each first (first-call costs, and llguidance
builds its lexer lazily while the first masks are computed), not counted. Headline figures are
medians of generated tokens per second of wall time.

Compile time: a fresh compiler (its tokenizer already built: that is once per engine, printed
separately), so the cache is empty (cold), then the same schema again (cached).
Last line: JSON with constrained_tok_s, free_tok_s, constrained_vs_free (goal: >= 0.8),
compile_cold_s, compile_cached_s.

    .venv/bin/python benchmarks/structured_overhead.py [--batch 8] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.sampling_params import StructuredOutput  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.structured import GrammarCompiler  # noqa: E402

GOAL = 0.8
SCHEMA = {
    "type": "object",
    "properties": {
        "team": {"type": "string", "maxLength": 24},
        "region": {"enum": ["emea", "apac", "amer"]},
        "members": {"type": "array", "minItems": 6, "maxItems": 10, "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "age": {"type": "integer", "minimum": 18, "maximum": 99},
                "role": {"enum": ["engineer", "manager", "designer", "analyst"]},
                "email": {"type": "string", "pattern": "^[a-z]{2,12}@[a-z]{2,12}\\.(com|org)$"},
                "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
                "office": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                            "floor": {"type": "integer"}},
                           "required": ["city", "floor"], "additionalProperties": False},
            },
            "required": ["name", "age", "role", "email", "skills", "office"],
            "additionalProperties": False}},
    },
    "required": ["team", "region", "members"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Describe a software team of at least six people as JSON: team name, region, "
                                    "and members with name, age, role, email, skills and office."}]


def run(llm: LLM, params: list[SamplingParams]) -> tuple[float, int, list[str | None]]:
    start = time.perf_counter()
    outs = llm.chat([CHAT] * len(params), params)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.token_ids) for o in outs), [o.finish_reason for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    llm = LLM(None, kv_cache_gib=1.0, max_num_batched_tokens=1024)
    engine = llm.engine
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    seeds = range(args.batch)
    free = [SamplingParams(temperature=0.8, seed=s, max_tokens=args.max_tokens, ignore_eos=True) for s in seeds]
    constrained = [SamplingParams(temperature=0.8, seed=s, max_tokens=args.max_tokens, structured=structured)
                   for s in seeds]

    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    start = time.perf_counter()
    _ = compiler.lltokenizer
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    first = compiler.compile(structured)
    compile_cold_s = time.perf_counter() - start
    start = time.perf_counter()
    again = compiler.compile(structured)
    compile_cached_s = time.perf_counter() - start
    assert again is first and compiler.num_hits == 1
    print(f"tokenizer for the grammar library: {tokenizer_s:.3f} s (once per engine); compile cold "
          f"{compile_cold_s * 1e3:.2f} ms, cached {compile_cached_s * 1e6:.1f} µs", file=sys.stderr)

    run(llm, free[:2])  # warm-up
    run(llm, constrained[:2])
    rates: dict[str, list[float]] = {"free": [], "constrained": []}
    for rep in range(args.repeats):
        for name, params in (("free", free), ("constrained", constrained)):
            seconds, num_tokens, reasons = run(llm, params)
            rates[name].append(num_tokens / seconds)
            print(f"rep {rep} {name}: {num_tokens} tokens in {seconds:.2f} s = {num_tokens / seconds:.1f} tok/s, "
                  f"finish {sorted(set(reasons))}", file=sys.stderr)
            assert num_tokens == args.batch * args.max_tokens, "a request stopped early: the numbers would not compare"
    free_tok_s = statistics.median(rates["free"])
    constrained_tok_s = statistics.median(rates["constrained"])
    ratio = constrained_tok_s / free_tok_s
    print(f"constrained / free = {ratio:.3f} (goal >= {GOAL})", file=sys.stderr)
    print(json.dumps({
        "constrained_tok_s": round(constrained_tok_s, 2),
        "free_tok_s": round(free_tok_s, 2),
        "constrained_vs_free": round(ratio, 3),
        "compile_cold_s": round(compile_cold_s, 5),
        "compile_cached_s": round(compile_cached_s, 7),
    }))


if __name__ == "__main__":
    main()
