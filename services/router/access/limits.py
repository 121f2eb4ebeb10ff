"""Per-key limits: requests per minute, tokens per minute, requests at once.

Two token buckets per key, each holding at most one minute's allowance (``capacity`` = the
per-minute limit) and refilling continuously at ``capacity / 60`` per second::

    level(now) = min(capacity, level + (now - at) * capacity / 60)

    rpm: admission needs level >= 1 and takes 1 from it
    tpm: admission needs level > 0 and takes nothing; when the request ends its actual tokens
         (prompt + generated) are taken, so the level may go negative and blocks until refilled

A refusal names the limit that keeps the key waiting longest and ``retry_after_s``, the whole
seconds until a request would pass (if nothing else uses the key meanwhile)::

    rpm: ceil((1 - level) * 60 / rpm)           the level reaches 1
    tpm: floor(-level * 60 / tpm) + 1           the level is above 0 (not merely 0)
    max_concurrency: 1                          no clock says when a request ends

(at least 1 s each; a nanosecond of floating-point error is forgiven either way, so 0.95 + 0.05
waits 1 s, not 2).
:class:`LocalLimiter` keeps the buckets in this process (one router); ``redis_access.RedisLimiter``
runs the same rules in Redis for routers that share keys. ``tests/unit/router/test_limits.py``
runs one suite against both.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

Clock = Callable[[], float]
ROUNDING_S = 1e-9


@dataclass(frozen=True)
class Limits:
    """One key's limits; 0: unlimited."""

    rpm: int = 0
    tpm: int = 0
    max_concurrency: int = 0

    @property
    def is_unlimited(self) -> bool:
        return not (self.rpm or self.tpm or self.max_concurrency)


@dataclass(frozen=True)
class Refusal:
    """Over a limit: which one, and the whole seconds until a request would pass."""

    limit: str
    retry_after_s: int

    def message(self, limits: Limits) -> str:
        if self.limit == "rpm":
            return (f"rate limit reached: this API key may send {limits.rpm} requests per minute; "
                    f"retry in {self.retry_after_s} s")
        if self.limit == "tpm":
            return (f"rate limit reached: this API key may use {limits.tpm} tokens per minute (prompt + "
                    f"generated); retry in {self.retry_after_s} s")
        return (f"concurrency limit reached: this API key may have {limits.max_concurrency} requests "
                "in flight at once; retry when one of them finishes")


@dataclass(frozen=True)
class Lease:
    """An admitted request: give it back with ``release`` (its concurrency slot, its tokens)."""

    key_id: str
    limits: Limits
    lease_id: str


def refilled(level: float, at: float, capacity: int, now: float) -> float:
    """A bucket's level at ``now`` that was ``level`` at ``at``."""
    return min(float(capacity), level + max(0.0, now - at) * capacity / 60)


def refusal(limits: Limits, rpm_level: float, tpm_level: float, num_in_flight: int) -> Refusal | None:
    """None if a request may start now; else the limit with the longest wait (the first on a tie)."""
    refusals = []
    if limits.rpm and rpm_level < 1:
        refusals.append(Refusal("rpm", max(1, math.ceil((1 - rpm_level) * 60 / limits.rpm - ROUNDING_S))))
    if limits.tpm and tpm_level <= 0:
        refusals.append(Refusal("tpm", max(1, math.floor(-tpm_level * 60 / limits.tpm + ROUNDING_S) + 1)))
    if limits.max_concurrency and num_in_flight >= limits.max_concurrency:
        refusals.append(Refusal("max_concurrency", 1))
    return max(refusals, key=lambda r: r.retry_after_s, default=None)


class Limiter(Protocol):
    """Where the buckets and in-flight counts live (this process, or Redis)."""

    renew_every_s: float | None
    """How often an admitted request's lease must be renewed while it runs (None: never)."""

    async def acquire(self, key_id: str, limits: Limits) -> Lease | Refusal: ...
    async def release(self, lease: Lease, num_tokens: int) -> None: ...
    async def renew(self, lease: Lease) -> None: ...
    async def num_in_flight(self, key_id: str) -> int: ...


@dataclass
class _Bucket:
    level: float
    at: float


class LocalLimiter:
    """The buckets in this process: limits hold per router."""

    renew_every_s = None

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._in_flight: dict[str, int] = {}

    def _level(self, key_id: str, limit: str, capacity: int, now: float) -> float:
        bucket = self._buckets.get((key_id, limit))
        return float(capacity) if bucket is None else refilled(bucket.level, bucket.at, capacity, now)

    async def acquire(self, key_id: str, limits: Limits) -> Lease | Refusal:
        now = self.clock()
        rpm_level = self._level(key_id, "rpm", limits.rpm, now)
        tpm_level = self._level(key_id, "tpm", limits.tpm, now)
        refused = refusal(limits, rpm_level, tpm_level, self._in_flight.get(key_id, 0))
        if refused is not None:
            return refused
        if limits.rpm:
            self._buckets[key_id, "rpm"] = _Bucket(rpm_level - 1, now)
        if limits.max_concurrency:
            self._in_flight[key_id] = self._in_flight.get(key_id, 0) + 1
        return Lease(key_id, limits, uuid.uuid4().hex)

    async def release(self, lease: Lease, num_tokens: int) -> None:
        # No await in here: a release in a cancelled task's ``finally`` still runs to the end.
        key_id, limits = lease.key_id, lease.limits
        if limits.max_concurrency:
            left = self._in_flight.get(key_id, 0) - 1
            assert left >= 0, f"key {key_id[:12]} released more requests than it acquired"
            if left:
                self._in_flight[key_id] = left
            else:
                self._in_flight.pop(key_id, None)
        if limits.tpm and num_tokens > 0:
            now = self.clock()
            self._buckets[key_id, "tpm"] = _Bucket(self._level(key_id, "tpm", limits.tpm, now) - num_tokens, now)

    async def renew(self, lease: Lease) -> None:
        """Nothing to renew: a slot here cannot outlive the process that holds it."""

    async def num_in_flight(self, key_id: str) -> int:
        return self._in_flight.get(key_id, 0)
