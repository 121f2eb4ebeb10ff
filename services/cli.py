"""The ``epd`` command.

Usage:
    epd up [--prefills N] [--decodes N] [--encoders N] [--port 8000] ...   (the local cluster)
    epd up --ray [--ray-address HOST:PORT] ...                               (the same cluster on Ray)
    epd admin instances | router | drain ID | undrain ID | policies | policy ROLE NAME | buckets ... | keys ...
    epd chat "message" [--model M] [--max-tokens N] [--temperature T] [--seed S]
    epd generate "prompt" [--model M] [--max-tokens N] [--temperature T] [--seed S]

Both run the offline engine in this process (SmolLM2-135M-Instruct unless ``--model`` names
a GGUF file or a Hugging Face directory) and print the answer.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from services.common.errors import EPDError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description="epd: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start the local cluster (encoder, prefill, decode, router), or with --ray "
                              "on a Ray cluster; see epd up --help")
    sub.add_parser("admin", help="the router's admin API (instances, drain, policies, buckets, API keys); "
                                     "see epd admin --help")
    for name, help_text in (("chat", "answer one chat message with the model's chat template"),
                            ("generate", "continue a raw text prompt")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("text")
        p.add_argument("--model", default=None, help="model name, .gguf file or HF directory")
        p.add_argument("--max-tokens", type=int, default=64)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("-v", "--verbose", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["up"]:
        from services.launcher import main as up, parse
        config = parse(argv[1:])
        if config.ray:   # Ray is imported only then (services/ray_cluster)
            from services.ray_cluster.up import main as up_on_ray
            return up_on_ray(config)
        return up(config)
    if argv[:1] == ["admin"]:
        from services.router.admin.cli import main as admin
        return admin(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from services.engine import LLM, SamplingParams

    try:
        start = time.perf_counter()
        llm = LLM(args.model, kv_cache_gib=0.25)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        loaded = time.perf_counter()
        if args.command == "chat":
            out = llm.chat([{"role": "user", "content": args.text}], params)[0]
        else:
            out = llm.generate(args.text, params)[0]
    except EPDError as e:
        print(f"epd: error: {e}", file=sys.stderr)
        return 2
    done = time.perf_counter()
    print(out.text.strip())
    print(f"[{llm.engine.model_config.name}: loaded in {loaded - start:.2f}s, "
          f"{len(out.token_ids)} tokens in {done - loaded:.2f}s, finish_reason={out.finish_reason}]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
