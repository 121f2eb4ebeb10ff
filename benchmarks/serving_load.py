"""The serving benchmark's own load client (benchmarks/serving.py): prompts of an exact token
count, streamed chat requests timed as aiperf times them, and the figures of a run."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx

MODEL_NAME = "SmolLM2-135M-Instruct"
REQUEST_TIMEOUT_S = 600.0
ONE_TOKEN_WORD = re.compile(r"^Ġ[a-z]{3,12}$")
"""Byte-level BPE spelling of " word": a space and a lower-case word, one token."""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_prompts(tokenizer_dir: Path, num_prompts: int, num_tokens: int, seed: int) -> list[str]:
    """``num_prompts`` texts of exactly ``num_tokens`` tokens each: random one-token words."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    words = sorted(token[1:] for token in tokenizer.get_vocab() if ONE_TOKEN_WORD.match(token))
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        chosen = [rng.choice(words) for _ in range(num_tokens)]
        for _ in range(100):   # a word that merges with its neighbour: trim or add until exact
            count = len(tokenizer.encode(" ".join(chosen), add_special_tokens=False).ids)
            if count == num_tokens:
                break
            if count > num_tokens:
                chosen.pop()
            else:
                chosen.append(rng.choice(words))
        else:
            raise RuntimeError(f"could not build a prompt of exactly {num_tokens} tokens")
        prompts.append(" ".join(chosen))
    return prompts


@dataclass(frozen=True)
class Sample:
    ttft_s: float = 0.0
    itl_s: float = 0.0
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    """As the server counts them: the chat template's tokens too."""
    num_cached_tokens: int = 0
    """Prompt tokens the server found in its prefix cache."""
    error: str = ""


def chat_body(prompt: str, output_tokens: int) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": output_tokens,
            "min_tokens": output_tokens, "ignore_eos": True}


class StreamError(Exception):
    """A streamed chat request that the server answered with an error (status or event)."""


async def chat_events(client: httpx.AsyncClient, url: str, body: dict) -> AsyncIterator[dict]:
    """The JSON events of one streamed chat completion (benchmarks/serving.py, chaos.py);
    StreamError for a non-200 answer or an error event, httpx.HTTPError / ValueError as they come."""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise StreamError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                raise StreamError(f"error event: {error.get('message', error) if isinstance(error, dict) else error}")
            yield event


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> Sample:
    """aiperf's definitions: TTFT to the first chunk with content; ITL (end of the stream - that
    chunk) / (output tokens - 1), the same whether a server sends one token per chunk or several."""
    start = time.perf_counter()
    first = None
    usage: dict = {}
    try:
        async for event in chat_events(client, url, body):
            if first is None and any(c.get("delta", {}).get("content") for c in event.get("choices", ())):
                first = time.perf_counter()
            usage = event.get("usage") or usage
        end = time.perf_counter()
    except StreamError as exc:
        return Sample(error=str(exc))
    except (httpx.HTTPError, ValueError) as exc:   # ValueError: an event that is not JSON
        return Sample(error=f"{type(exc).__name__}: {exc}")
    if first is None or not usage:
        return Sample(error="no content" if first is None else "no usage chunk")
    num_tokens = usage["completion_tokens"]
    return Sample(first - start, (end - first) / max(1, num_tokens - 1), num_tokens, usage["prompt_tokens"],
                  (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def run_load(url: str, prompts: list[str], concurrency: int, output_tokens: int) -> tuple[list[Sample], float]:
    """Every prompt once, ``concurrency`` at a time; the samples and the wall time."""
    queue = list(prompts)
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0), limits=limits) as client:
        async def worker() -> None:
            while queue:
                samples.append(await one_request(client, url, chat_body(queue.pop(0), output_tokens)))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return samples, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, as aiperf reports)."""
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def figures(name: str, samples: list[Sample], wall_s: float, output_tokens: int) -> dict:
    good = [s for s in samples if not s.error]
    errors = [s.error for s in samples if s.error]
    if errors:
        log(f"{name}: {len(errors)} failed requests, e.g. {errors[0]}")
    result = {f"{name}_requests": len(samples), f"{name}_errors": len(errors),
              f"{name}_wrong_lengths": sum(s.num_output_tokens != output_tokens for s in good),
              f"{name}_output_tok_s": round(sum(s.num_output_tokens for s in good) / wall_s, 2),
              f"{name}_prompt_cached_pct": round(100 * sum(s.num_cached_tokens for s in good)
                                                 / max(1, sum(s.num_prompt_tokens for s in good)), 2),
              f"{name}_wall_s": round(wall_s, 2)}
    if good:
        ttft_ms, itl_ms = [s.ttft_s * 1e3 for s in good], [s.itl_s * 1e3 for s in good]
        result.update({f"{name}_ttft_ms_p50": round(percentile(ttft_ms, 0.5), 2),
                       f"{name}_ttft_ms_p99": round(percentile(ttft_ms, 0.99), 2),
                       f"{name}_itl_ms_mean": round(sum(itl_ms) / len(itl_ms), 3),
                       f"{name}_itl_ms_p50": round(percentile(itl_ms, 0.5), 3)})
    return result


# ---------------------------------------------------------------- the load (aiperf)
