"""Step-time cost models: what a prefill chunk or a decode step costs, fitted from measurements.

One formula for a prefill step that computes ``n`` new tokens after ``ctx`` cached ones::

    t(n, ctx) = a + b * n + d * (n * ctx + n**2 / 2)

``a`` is the fixed cost of a step (launches, sampling), ``b`` the per-token cost of the dense
layers, ``d`` attention: each new token attends to the ctx tokens before the chunk and to half
of the chunk on average. It is linear in (a, b, d), so a least-squares fit over measured
(n, ctx, seconds) samples is exact arithmetic, and :meth:`PrefillCost.tokens_within` inverts it
(the positive root of a quadratic) to size a chunk for a time budget.

Decode: ``t(batch, kv) = a + b * batch + c * kv`` for one step of ``batch`` sequences holding
``kv`` tokens of KV in total.

Defaults follow the reference numbers of SPEC.md (per card: chunk 4,096 in 68 ms, 65,536 in
740 ms; decode ~3.1 ms per step at concurrency 8, ~9.5 ms at 256). Router, simulator and
engine all import these; torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PrefillCost:
    a: float = 0.023
    """Seconds per step, whatever its size."""
    b: float = 10.9e-6
    """Seconds per new token (dense layers)."""
    d: float = 2.0e-12
    """Seconds per (new token x attended token) pair."""

    def seconds(self, num_new: int, num_ctx: int = 0) -> float:
        if num_new <= 0:
            return 0.0
        return self.a + self.b * num_new + self.d * (num_new * num_ctx + num_new * num_new / 2)

    def prompt_seconds(self, num_tokens: int, num_cached: int = 0, chunk: int = 0) -> float:
        """A whole prompt's compute after ``num_cached`` hit tokens, in chunks of ``chunk``
        tokens (0: one step)."""
        num_new = max(0, num_tokens - num_cached)
        if chunk <= 0 or num_new <= chunk:
            return self.seconds(num_new, num_cached)
        total, done = 0.0, num_cached
        while done < num_tokens:
            n = min(chunk, num_tokens - done)
            total += self.seconds(n, done)
            done += n
        return total

    def tokens_within(self, budget_s: float, num_ctx: int = 0) -> int:
        """The most new tokens one step may compute after ``num_ctx`` tokens within
        ``budget_s`` (at least 1: a step always makes progress)."""
        free = budget_s - self.a
        if free <= 0:
            return 1
        # d/2 n^2 + (b + d ctx) n - free = 0
        lin = self.b + self.d * num_ctx
        if self.d <= 0:
            return max(1, int(free / lin)) if lin > 0 else 1
        half_d = self.d / 2
        n = int((-lin + math.sqrt(lin * lin + 4 * half_d * free)) / (2 * half_d))
        if self.seconds(n + 1, num_ctx) <= budget_s:  # the root landed a hair below a whole token
            n += 1
        return max(1, n)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]], prior: PrefillCost | None = None) -> PrefillCost:
        """Least squares over (num_new, num_ctx, seconds); coefficients are kept >= 0. With
        fewer than 3 distinct samples the prior (default: the reference) is returned."""
        prior = prior or cls()
        rows = [(1.0, n, n * c + n * n / 2) for n, c, _ in samples if n > 0]
        if len(set(rows)) < 3:
            return prior
        x = np.array(rows, dtype=np.float64)
        y = np.array([t for n, _, t in samples if n > 0], dtype=np.float64)
        # Scale the columns so the solve is well conditioned (n^2 terms reach 1e9 and more).
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
        coef, *_ = np.linalg.lstsq(x / scale, y, rcond=None)
        a, b, d = (max(0.0, float(v)) for v in coef / scale)
        return cls(a, b, d)


@dataclass(frozen=True)
class DecodeCost:
    a: float = 0.0028
    """Seconds per step, whatever its size."""
    b: float = 2.6e-5
    """Seconds per sequence in the batch."""
    c: float = 1.0e-10
    """Seconds per token of KV read by the step."""

    def seconds(self, batch: int, num_kv_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self.a + self.b * batch + self.c * num_kv_tokens
