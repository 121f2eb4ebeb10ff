"""Per-key limits: one suite against the in-process limiter and the Redis one (a real redis-server),
then what only Redis does: one limit for several routers, leases that outlive a dead router."""

from __future__ import annotations

import asyncio

import pytest

from services.router.access.limits import Lease, Limits, LocalLimiter, Refusal, refilled, refusal
from tests.unit.router.gate_fakes import FakeClock, RedisBacked

KEY, OTHER = "a" * 64, "b" * 64


class Limiters(RedisBacked):
    """Limiters of one kind sharing one state (one Redis prefix), made inside the test's loop."""

    def __init__(self, kind: str, clock, redis_url: str | None) -> None:
        super().__init__(kind, redis_url)
        self.clock = clock

    def make(self, clock="default", lease_ttl_s: float = 60.0):
        clock = self.clock if clock == "default" else clock
        if self.kind == "local":
            return LocalLimiter(clock)
        from services.router.access.redis_access import RedisLimiter
        return RedisLimiter(self.redis_client(), self.prefix, clock, lease_ttl_s)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["local", "redis"])
def limiters(request, clock) -> Limiters:
    return Limiters(request.param, clock, request.getfixturevalue("redis_url") if request.param == "redis" else None)


@pytest.fixture
def redis_limiters(redis_url, clock) -> Limiters:
    return Limiters("redis", clock, redis_url)


def test_bucket_arithmetic_is_exact_for_whole_numbers():
    assert refilled(-50.0, 0.0, 100, 30.0) == 0.0
    assert refilled(0.0, 0.0, 100, 10_000.0) == 100.0
    assert refusal(Limits(rpm=2), 0.0, 0.0, 0) == Refusal("rpm", 30)
    assert refusal(Limits(tpm=100), 0.0, -50.0, 0) == Refusal("tpm", 31)
    assert refusal(Limits(tpm=100), 0.0, 0.0, 0) == Refusal("tpm", 1)
    assert refusal(Limits(rpm=2, tpm=100, max_concurrency=1), 1.0, 0.5, 0) is None


def test_requests_per_minute(limiters, clock):
    async def test():
        limiter = limiters.make()
        limits = Limits(rpm=3)
        assert all([isinstance(await limiter.acquire(KEY, limits), Lease) for _ in range(3)])
        assert await limiter.acquire(KEY, limits) == Refusal("rpm", 20)  # 3 a minute: one per 20 s
        clock.advance(19)
        assert await limiter.acquire(KEY, limits) == Refusal("rpm", 1)
        clock.advance(1)
        assert isinstance(await limiter.acquire(KEY, limits), Lease)
        assert isinstance(await limiter.acquire(OTHER, limits), Lease)  # keys do not share buckets
        clock.advance(10_000)  # a long pause refills no more than one minute's worth
        assert [isinstance(await limiter.acquire(KEY, limits), Lease) for _ in range(4)] == [True] * 3 + [False]
    limiters.run(test)


def test_tokens_per_minute_are_charged_after_the_request(limiters, clock):
    async def test():
        limiter = limiters.make()
        limits = Limits(tpm=120)
        first = await limiter.acquire(KEY, limits)
        second = await limiter.acquire(KEY, limits)  # admission takes nothing from the bucket
        assert isinstance(first, Lease) and isinstance(second, Lease)
        await limiter.release(first, 100)
        await limiter.release(second, 80)  # 120 - 180: the bucket is 60 in debt
        assert await limiter.acquire(KEY, limits) == Refusal("tpm", 31)  # 60 tokens take 30 s; positive after
        clock.advance(30)
        assert await limiter.acquire(KEY, limits) == Refusal("tpm", 1)  # exactly 0 is not positive
        clock.advance(1)
        third = await limiter.acquire(KEY, limits)
        assert isinstance(third, Lease)
        await limiter.release(third, 0)
        assert isinstance(await limiter.acquire(KEY, limits), Lease)
    limiters.run(test)


def test_concurrency(limiters):
    async def test():
        limiter = limiters.make()
        limits = Limits(max_concurrency=2)
        leases = [await limiter.acquire(KEY, limits) for _ in range(2)]
        assert await limiter.acquire(KEY, limits) == Refusal("max_concurrency", 1)
        assert await limiter.num_in_flight(KEY) == 2
        await limiter.release(leases[0], 0)
        leases.append(await limiter.acquire(KEY, limits))
        assert isinstance(leases[-1], Lease)
        for lease in leases[1:]:
            await limiter.release(lease, 0)
        assert await limiter.num_in_flight(KEY) == 0
    limiters.run(test)


def test_the_longest_wait_is_the_one_reported(limiters):
    async def test():
        limiter = limiters.make()
        limits = Limits(rpm=1, tpm=60, max_concurrency=1)
        lease = await limiter.acquire(KEY, limits)
        assert await limiter.acquire(KEY, limits) == Refusal("rpm", 60)  # rpm 60 s beats concurrency 1 s
        await limiter.release(lease, 600)
        assert await limiter.acquire(KEY, limits) == Refusal("tpm", 541)  # 540 in debt at 1 token/s
    limiters.run(test)


def test_two_routers_on_one_redis_admit_exactly_the_limit(redis_limiters):
    async def test():
        first, second = redis_limiters.make(), redis_limiters.make()
        limits = Limits(rpm=10)
        outcomes = await asyncio.gather(*(limiter.acquire(KEY, limits) for _ in range(30)
                                          for limiter in (first, second)))
        assert sum(isinstance(o, Lease) for o in outcomes) == 10
        assert {o for o in outcomes if isinstance(o, Refusal)} == {Refusal("rpm", 6)}
    redis_limiters.run(test)


def test_redis_own_clock_admits_exactly_the_limit(redis_limiters):
    """Without a test clock the script reads Redis's TIME (one clock for every router)."""
    async def test():
        first, second = redis_limiters.make(clock=None), redis_limiters.make(clock=None)
        limits = Limits(rpm=5)  # one more every 12 s: far longer than this test
        outcomes = await asyncio.gather(*(limiter.acquire(KEY, limits) for _ in range(10)
                                          for limiter in (first, second)))
        assert sum(isinstance(o, Lease) for o in outcomes) == 5
        refusals = [o for o in outcomes if isinstance(o, Refusal)]
        assert all(o.limit == "rpm" and 1 <= o.retry_after_s <= 12 for o in refusals) and len(refusals) == 15
    redis_limiters.run(test)


def test_concurrency_and_tokens_are_shared_through_redis(redis_limiters):
    async def test():
        first, second = redis_limiters.make(), redis_limiters.make()
        limits = Limits(tpm=60, max_concurrency=2)
        held = [await first.acquire(KEY, limits), await first.acquire(KEY, limits)]
        assert await second.acquire(KEY, limits) == Refusal("max_concurrency", 1)
        await first.release(held[0], 90)  # charged on one router ...
        assert await second.acquire(KEY, limits) == Refusal("tpm", 31)  # ... refused on the other
        await first.release(held[1], 0)
        assert await second.num_in_flight(KEY) == 0
    redis_limiters.run(test)


def test_a_dead_routers_slots_expire_unless_renewed(redis_limiters, clock):
    async def test():
        alive, dead = redis_limiters.make(lease_ttl_s=60), redis_limiters.make(lease_ttl_s=60)
        limits = Limits(max_concurrency=2)
        renewed, abandoned = await alive.acquire(KEY, limits), await dead.acquire(KEY, limits)
        clock.advance(50)
        await alive.renew(renewed)
        await dead.renew(Lease(KEY, limits, "never-acquired"))  # renewing creates nothing
        clock.advance(20)  # 70 s: the abandoned lease is gone, the renewed one lives until 110 s
        taken = await alive.acquire(KEY, limits)
        assert isinstance(taken, Lease) and isinstance(abandoned, Lease)
        assert await alive.acquire(KEY, limits) == Refusal("max_concurrency", 1)
        clock.advance(41)
        await alive.renew(renewed)  # too late: it expired and stays expired
        assert isinstance(await alive.acquire(KEY, limits), Lease)
    redis_limiters.run(test)
