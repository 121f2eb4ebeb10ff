"""Redis as every service talks to it: a dependency that degrades, never one that stops a process.

Clients (:func:`sync_client`, :func:`async_client`) fail fast: a short connect and socket
timeout, two quick retries of a refused connection inside one call (redis-py's ``Retry`` with
exponential back-off), and a broken connection is replaced by a new one on the next call, so
service comes back by itself when Redis does, without a restart.

:class:`RedisHealth` is what one process knows of its Redis: up, or down since when. It logs the
change once per outage (not once per failed call), counts outages, sets a gauge, and acts as a
circuit breaker: while Redis is down, :meth:`RedisHealth.guard` refuses calls at once
(:class:`RedisSkipped`) until the next probe is due, the probe period backing off from
PROBE_BASE_S to PROBE_MAX_S. So a request waits on a dead Redis at most once per probe period,
and for at most about one connect timeout::

    up ──ConnectionError / TimeoutError──► down: calls skipped until next_probe_at
     ▲                                        │ a call after next_probe_at (a probe)
     └──────────── the probe succeeds ────────┘ fails: next_probe_at moves out (back-off)
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.retry
from redis.backoff import ExponentialBackoff

from services.common import metrics
from services.common.retry import backoff_s

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 0.5
SOCKET_TIMEOUT_S = 1.0
"""A command with no reply within this counts as Redis being down (the scripts run in microseconds)."""
NUM_RETRIES = 2
"""Retries of a refused or dropped connection within one call. Timeouts are not retried: a
script that timed out may have run, and running an admission twice would charge it twice."""
PROBE_BASE_S = 0.25
PROBE_MAX_S = 4.0
"""Also how long a probe that never ends (cancelled) holds off the next one."""

OUTAGES = metrics.counter("epd_redis_outages", "Times this process found its Redis unavailable (one per outage, "
                          "not per failed call)")
AVAILABLE = metrics.gauge("epd_redis_available", "1 while this process's Redis answers, 0 while it is down")


class RedisSkipped(redis.ConnectionError):
    """Not sent: Redis is down and the next probe is not due yet."""


def _options(retry_class) -> dict:
    backoff = ExponentialBackoff(cap=0.2, base=0.05)
    return {"socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_timeout": SOCKET_TIMEOUT_S,
            "retry": retry_class(backoff, NUM_RETRIES, supported_errors=(redis.ConnectionError,))}


def sync_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, **_options(redis.retry.Retry))


def async_client(url: str) -> redis.asyncio.Redis:
    return redis.asyncio.Redis.from_url(url, **_options(redis.asyncio.retry.Retry))


def is_outage(error: BaseException) -> bool:
    """Redis unreachable or not answering (AuthenticationError included: a connection refused
    at login); a script or command error is a bug, not an outage."""
    return isinstance(error, (redis.ConnectionError, redis.TimeoutError))


class RedisHealth:
    """Up or down, as this process's last calls found its Redis (shared by every caller of one client)."""

    def __init__(self, what: str, clock: Callable[[], float] = time.monotonic,
                 rng: Callable[[], float] = random.random) -> None:
        self.what = what
        """Who depends on it, for logs: "router", "kvstore node kvstore-0"."""
        self.clock = clock
        self.rng = rng
        self.is_available = True
        self.down_since: float | None = None
        self.num_outages = 0
        self._num_probes = 0
        self._next_probe_at = float("-inf")
        AVAILABLE.set(1)

    def is_worth_trying(self) -> bool:
        return self.is_available or self.clock() >= self._next_probe_at

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around one call (sync or async code alike): skipped while down, outcome recorded."""
        if not self.is_available:
            now = self.clock()
            if now < self._next_probe_at:
                raise RedisSkipped(f"Redis is down (for {now - self.down_since:.1f} s); "
                                   f"next try in {self._next_probe_at - now:.1f} s")
            self._next_probe_at = now + PROBE_MAX_S  # this call is the probe: concurrent ones keep skipping
        try:
            yield
        except Exception as exc:
            if is_outage(exc):
                self.failed(exc)
            elif isinstance(exc, redis.RedisError):
                self.succeeded()  # an error reply is still a reply: Redis is up
            raise
        self.succeeded()

    def failed(self, error: BaseException) -> bool:
        """Record a failed call; True when it starts an outage."""
        now = self.clock()
        self._next_probe_at = now + max(PROBE_BASE_S, backoff_s(self._num_probes, 2 * PROBE_BASE_S,
                                                                PROBE_MAX_S, self.rng))
        self._num_probes += 1
        if not self.is_available:
            return False
        self.is_available, self.down_since = False, now
        self.num_outages += 1
        OUTAGES.inc()
        AVAILABLE.set(0)
        logger.warning("%s: Redis is unavailable (%s); degrading until it is back", self.what, error)
        return True

    def succeeded(self) -> None:
        if self.is_available:
            return
        logger.warning("%s: Redis is back after %.1f s", self.what, self.clock() - self.down_since)
        self.is_available, self.down_since = True, None
        self._num_probes, self._next_probe_at = 0, float("-inf")
        AVAILABLE.set(1)
