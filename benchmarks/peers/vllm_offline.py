"""vLLM offline driver, run under .venv-vllm/bin/python by VllmCpu (it imports vLLM only).

    vllm_offline.py --model DIR --dtype float32 [--max-num-batched-tokens 2048]

Loads the model once, then prints one JSON line {"ready": true, "version": ...} and answers each
stdin line {"prompts": [[token ids]...], "max_tokens": N} with one JSON line
{"seconds": ..., "token_ids": [[...]...]}: one LLM.generate over TokensPrompts, greedy, no EOS
stop, timed alone. Only these lines go to stdout; vLLM's logging is moved to stderr. A request
may also give "params" (more SamplingParams fields, e.g. {"temperature": 0.7, "seed": 3,
"ignore_eos": false}, over the greedy defaults): the --engine vllm tests' reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True, choices=["float32", "bfloat16"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=None, help="vLLM's default if unset")
    parser.add_argument("--enable-prefix-caching", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile warm-up (~90 s on 2 cores)")
    args = parser.parse_args()

    # vLLM logs to stdout, in this process and its engine-core child: keep stdout for the replies.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, tokenizer=args.model, dtype=args.dtype, seed=0,
              max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
              **({"block_size": args.block_size} if args.block_size else {}))
    print(json.dumps({"ready": True, "version": vllm.__version__}), file=replies)
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(**{"temperature": 0, "max_tokens": request["max_tokens"], "ignore_eos": True,
                                   **request.get("params", {})})
        prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}),
              file=replies)


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing: the guard is needed
    main()
