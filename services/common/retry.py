"""The one retry helper (STYLE rule 11): exponential backoff with full jitter.

Only errors the caller names retryable are retried; everything else, and cancellation, passes
straight through. Typical use, retrying what ``EPDError.retryable`` marks (UNAVAILABLE)::

    reply = await retry(lambda: stub.Prefill(request), retry_on=is_retryable)
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc.aio

from services.common.errors import EPDError
from services.common.grpc_errors import error_from_rpc

logger = logging.getLogger(__name__)

T = TypeVar("T")


def is_retryable(error: BaseException) -> bool:
    """An EPDError marked retryable, or a gRPC call failing with such a status (UNAVAILABLE)."""
    if isinstance(error, grpc.aio.AioRpcError):
        error = error_from_rpc(error)
    return isinstance(error, EPDError) and error.retryable


def backoff_s(attempt: int, base_delay_s: float, max_delay_s: float,
              rng: Callable[[], float] = random.random) -> float:
    """The pause after failed attempt number ``attempt`` (0-based): uniform in [0, cap).

    cap = min(max_delay_s, base_delay_s * 2**attempt). Full jitter spreads the retries of many
    clients that failed together (an instance that just died) instead of synchronising them.
    """
    return rng() * min(max_delay_s, base_delay_s * 2 ** attempt)


async def retry(fn: Callable[[], Awaitable[T]], *, retry_on: Callable[[BaseException], bool],
                attempts: int = 3, base_delay_s: float = 0.05, max_delay_s: float = 1.0,
                sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                rng: Callable[[], float] = random.random) -> T:
    """``await fn()``, again after a pause while it raises what ``retry_on`` accepts.

    At most ``attempts`` calls; the last error is raised as is. ``sleep`` and ``rng`` are for tests.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1 (got {attempts})")
    for attempt in range(attempts):
        try:
            return await fn()
        except Exception as e:
            if attempt == attempts - 1 or not retry_on(e):
                raise
            delay = backoff_s(attempt, base_delay_s, max_delay_s, rng)
            logger.info("attempt %d/%d failed (%s: %s); retrying in %.3f s", attempt + 1, attempts,
                        type(e).__name__, e, delay)
            await sleep(delay)
    raise AssertionError("unreachable")
