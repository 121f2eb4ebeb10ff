"""The simulator's input: a Mooncake-format JSONL trace, one request a line.

    {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, ...]}

``timestamp`` is in milliseconds; ``hash_ids`` name the prompt's 512-token blocks, chained (two
prompts share block ids exactly as long as they share a prefix), the last one possibly partial.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

BLOCK_TOKENS = 512
"""Tokens per trace block (Mooncake's hash_ids)."""


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
