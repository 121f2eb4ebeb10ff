"""retry(): exponential backoff with full jitter, only for what retry_on accepts."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest

from services.common.errors import InvalidRequestError, UnavailableError
from services.common.retry import backoff_s, is_retryable, retry


class Flaky:
    """Fails with each of ``errors`` in turn, then returns "ok"; counts calls."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.num_calls = 0

    async def __call__(self) -> str:
        self.num_calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def run(fn: Flaky, **kwargs) -> tuple[str, list[float]]:
    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)

    kwargs.setdefault("retry_on", is_retryable)
    result = asyncio.run(retry(fn, sleep=sleep, rng=lambda: 1.0, **kwargs))
    return result, delays


def test_retries_with_exponential_backoff_capped():
    fn = Flaky(*[UnavailableError("busy")] * 4)
    assert run(fn, attempts=5, base_delay_s=0.1, max_delay_s=0.3) == ("ok", [0.1, 0.2, 0.3, 0.3])
    assert fn.num_calls == 5


def test_gives_up_after_attempts_with_the_last_error():
    fn = Flaky(UnavailableError("one"), UnavailableError("two"), UnavailableError("three"))
    with pytest.raises(UnavailableError, match="three"):
        run(fn, attempts=3)
    assert fn.num_calls == 3


def test_non_retryable_passes_straight_through():
    fn = Flaky(InvalidRequestError("bad"))
    with pytest.raises(InvalidRequestError, match="bad"):
        run(fn)
    assert fn.num_calls == 1


def test_retry_on_decides():
    fn = Flaky(KeyError("k"), KeyError("k"))
    assert run(fn, retry_on=lambda e: isinstance(e, KeyError))[0] == "ok"
    assert fn.num_calls == 3


def test_grpc_unavailable_is_retryable_and_invalid_argument_is_not():
    def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")

    assert is_retryable(rpc_error(grpc.StatusCode.UNAVAILABLE))
    assert not is_retryable(rpc_error(grpc.StatusCode.INVALID_ARGUMENT))
    assert not is_retryable(ValueError("x"))


def test_jitter_stays_below_the_cap():
    assert backoff_s(0, 0.05, 1.0, rng=lambda: 0.0) == 0.0
    assert backoff_s(3, 0.05, 1.0, rng=lambda: 0.5) == pytest.approx(0.2)
    assert backoff_s(10, 0.05, 1.0, rng=lambda: 0.999) < 1.0


def test_real_sleep_and_attempts_checked():
    assert asyncio.run(retry(Flaky(UnavailableError("x")), retry_on=is_retryable,
                             base_delay_s=0.001)) == "ok"
    with pytest.raises(ValueError, match="attempts"):
        asyncio.run(retry(Flaky(), retry_on=is_retryable, attempts=0))
