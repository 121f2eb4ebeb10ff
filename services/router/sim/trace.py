"""The simulator's input: a Mooncake-format JSONL trace, one request a line.

    {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, ...]}

``timestamp`` is in milliseconds; ``hash_ids`` name the prompt's 512-token blocks, chained (two
prompts share block ids exactly as long as they share a prefix), the last one possibly partial.

``phased`` builds a trace whose rate changes over time from a real one's requests (their
lengths and prefixes, in their order) and a list of :class:`Phase`: each phase's arrival rate,
reached by a linear ramp from the last one's, and a stream of the trace's long prompts only on
top (a surge of long prompts). Arrivals are Poisson at that rate (seeded thinning). A stream
that runs out of requests starts the trace over as another tenant, whose salt makes its blocks
distinct (``hash_ids`` shifted), so a replayed prompt hits no more than its first time did.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

BLOCK_TOKENS = 512
"""Tokens per trace block (Mooncake's hash_ids)."""


class SimClock:
    """The simulation's time, the trace's clock (arrivals are on it), callable like
    ``time.monotonic`` (policies and the KV store's index take it)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()

    def block_hashes(self) -> tuple[bytes, ...]:
        """The ids as the byte strings a policy sees (the live router's chained hashes are bytes)."""
        return tuple(block_id.to_bytes(8, "big") for block_id in self.hash_ids)

    def cached_tokens(self, num_hit_blocks: int) -> int:
        """Tokens a prefix hit of ``num_hit_blocks`` serves: at least the last prompt token is
        always computed (it yields the first output token)."""
        return max(0, min(num_hit_blocks * BLOCK_TOKENS, self.input_length - 1))


def parse(lines: Sequence[str]) -> list[TraceRequest]:
    """Requests in arrival order (ties keep the file's order); ids are the line numbers."""
    requests = []
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        row = json.loads(line)
        requests.append(TraceRequest(
            request_id=f"r{number}", arrival_s=float(row["timestamp"]) / 1000.0,
            input_length=int(row["input_length"]), output_length=max(1, int(row["output_length"])),
            hash_ids=tuple(int(h) for h in row.get("hash_ids", ()))))
    return sorted(requests, key=lambda r: r.arrival_s)


def load_trace(path: Path | str, limit: int = 0) -> list[TraceRequest]:
    """The trace at ``path``; with ``limit`` > 0, its first ``limit`` requests."""
    requests = parse(Path(path).read_text().splitlines())
    return requests[:limit] if limit > 0 else requests


def span_s(requests: Sequence[TraceRequest]) -> float:
    """Seconds from the first arrival to the last."""
    return requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0


def time_scaled(requests: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """The same requests with every gap between arrivals multiplied by ``factor`` (the first
    arrival stays where it is): ``factor`` < 1 offers the same work faster."""
    if not requests:
        return []
    start = requests[0].arrival_s
    return [replace(r, arrival_s=start + (r.arrival_s - start) * factor) for r in requests]


@dataclass(frozen=True)
class Phase:
    duration_s: float
    rate_req_s: float
    """Arrivals per second of the trace's own mix, reached ``ramp_s`` into the phase (linearly
    from the previous phase's rate)."""
    long_rate_req_s: float = 0.0
    """Arrivals per second of its long prompts only, on top (ramped the same way)."""


def phased(source: Sequence[TraceRequest], phases: Sequence[Phase], long_tokens: int = 32_768,
           ramp_s: float = 60.0, seed: int = 0) -> list[TraceRequest]:
    """The requests of ``source`` (in its order) arriving at the rates ``phases`` give, from 0 s;
    long prompts are those of at least ``long_tokens`` tokens."""
    long_ones = [r for r in source if r.input_length >= long_tokens]
    if not source or any(p.duration_s <= 0 or p.rate_req_s < 0 or p.long_rate_req_s < 0 for p in phases):
        raise ValueError("phased needs requests, and phases with a duration > 0 and rates >= 0")
    if any(p.long_rate_req_s > 0 for p in phases) and not long_ones:
        raise ValueError(f"the trace has no prompt of {long_tokens} tokens or more for a long-prompt phase")
    stride = 1 + max((max(r.hash_ids, default=0) for r in source), default=0)
    rng = random.Random(seed)
    arrivals = [(t, 0, r) for t, r in zip(_poisson(phases, lambda p: p.rate_req_s, ramp_s, rng),
                                          _replayed(source, stride, 0))]
    arrivals += [(t, 1, r) for t, r in zip(_poisson(phases, lambda p: p.long_rate_req_s, ramp_s, rng),
                                           _replayed(long_ones, stride, 1))]
    arrivals.sort(key=lambda a: (a[0], a[1]))
    return [replace(r, request_id=f"r{i}", arrival_s=t) for i, (t, _, r) in enumerate(arrivals)]


def _rate_at(phases: Sequence[Phase], rate_of, ramp_s: float, t: float) -> float:
    start, previous = 0.0, rate_of(phases[0])
    for phase in phases:
        if t < start + phase.duration_s:
            share = min(1.0, (t - start) / ramp_s) if ramp_s > 0 else 1.0
            return previous + (rate_of(phase) - previous) * share
        start, previous = start + phase.duration_s, rate_of(phase)
    return 0.0


def _poisson(phases: Sequence[Phase], rate_of, ramp_s: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process at the phases' rate: candidates at the peak rate,
    each kept with probability rate / peak (thinning)."""
    peak = max(rate_of(p) for p in phases)
    end = sum(p.duration_s for p in phases)
    times: list[float] = []
    t = 0.0
    while peak > 0:
        t += rng.expovariate(peak)
        if t >= end:
            break
        if rng.random() * peak < _rate_at(phases, rate_of, ramp_s, t):
            times.append(t)
    return times


def _replayed(requests: Sequence[TraceRequest], stride: int, stream: int) -> Iterator[TraceRequest]:
    """``requests`` over and over; each pass of each stream another tenant (its own block ids)."""
    copy = 0
    while True:
        shift = (2 * copy + stream) * stride
        for r in requests:
            yield replace(r, hash_ids=tuple(h + shift for h in r.hash_ids)) if shift else r
        copy += 1
