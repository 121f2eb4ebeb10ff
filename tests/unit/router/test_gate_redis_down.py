"""The gate while Redis is down (test doubles that fail the way the Redis adapters do): without
keys it asks Redis nothing per request, keys seen before keep working, unseen keys get 503,
a revoke still lands within the cache's TTL, and per-key limits fail open (this router's own
buckets) or closed (503 + Retry-After in the path's protocol) as configured."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest

from services.common.config import ConfigError, parse_config
from services.common.errors import UnavailableError
from services.router.access.auth import ApiKey, hash_key
from services.router.config import RouterConfig
from services.router.access.gate import REFUSALS, Gate
from services.router.access.key_cache import CachedKeyStore
from services.router.access.limits import Limits
from services.router.access.redis_access import LIMITS_DEGRADED, DegradingLimiter
from tests.unit.router.gate_fakes import Call, FakeClock, FlakyKeyStore, FlakyLimiter, TinyApp, bearer

GOOD, OTHER, LIMITED, HELD = "epd-good", "epd-other", "epd-limited", "epd-held"
TTL_S = 5.0


def make_tiny(clock: FakeClock, *, keys: bool = True, fail_open: bool = True,
              renew_every_s: float | None = None) -> tuple[TinyApp, FlakyKeyStore, FlakyLimiter]:
    store, limiter = FlakyKeyStore(), FlakyLimiter(clock, renew_every_s)
    if keys:
        for key in (ApiKey(hash_key(GOOD), "acme"), ApiKey(hash_key(OTHER), "acme"),
                    ApiKey(hash_key(LIMITED), "beta", rpm=2), ApiKey(hash_key(HELD), "gamma", max_concurrency=1)):
            asyncio.run(store.add(key))
    gate = Gate(CachedKeyStore(store, TTL_S, clock), DegradingLimiter(limiter, fail_open=fail_open), Limits(), 1000)
    return TinyApp(gate), store, limiter


def call(tiny: TinyApp, key: str | None = GOOD, path: str = "/v1/chat/completions", body: dict | None = None) -> Call:
    return Call(tiny.app(), path, bearer(key) if key else {}, json.dumps(body or {}).encode())


async def settle() -> None:
    """Let a background refresh the last request started run to its end."""
    for _ in range(5):
        await asyncio.sleep(0)


def refusals(reason: str, path: str = "/v1/chat/completions") -> float:
    return REFUSALS.labels(path, reason)._value.get()


def test_without_keys_no_request_asks_redis_anything():
    clock = FakeClock()
    tiny, store, _ = make_tiny(clock, keys=False)

    async def test():
        assert not await tiny.gate.store.has_keys()  # the router's start
        store.is_down = True
        assert [(await call(tiny, key=None).run()).status for _ in range(20)] == [200] * 20
        assert store.calls == {"has_keys": 1}
        clock.advance(TTL_S)  # a refresh is due: in the background, and its failure changes nothing
        assert (await call(tiny, key=None).run()).status == 200
        await settle()
        assert (await call(tiny, key=None).run()).status == 200 and store.calls == {"has_keys": 2}
        store.is_down = False
        await store.add(ApiKey(hash_key(GOOD), "acme"))  # another router made the first key
        assert (await call(tiny, key=None).run()).status == 200  # not known here before the next refresh
        clock.advance(TTL_S)
        await call(tiny, key=None).run()
        await settle()
        assert (await call(tiny, key=None).run()).status == 401
        assert (await call(tiny).run()).status == 200
        clock.advance(10 * TTL_S)  # latched: keys are checked for good, nobody asks again
        await call(tiny).run()
        assert store.calls["has_keys"] == 3
    asyncio.run(test())


def test_keys_seen_before_keep_working_while_redis_is_down_and_unseen_ones_get_503():
    clock = FakeClock()
    tiny, store, _ = make_tiny(clock)

    async def test():
        assert await tiny.gate.store.has_keys()
        assert (await call(tiny).run()).status == 200
        assert [(await call(tiny).run()).status for _ in range(5)] == [200] * 5
        assert store.calls["find"] == 1  # cached for TTL_S
        store.is_down = True
        clock.advance(TTL_S)
        assert (await call(tiny).run()).status == 200  # stale, but Redis cannot say otherwise
        assert store.calls["find"] == 2
        before = refusals("key_store_unavailable")
        unseen = await call(tiny, key=OTHER).run()
        assert unseen.status == 503 and unseen.headers["retry-after"] == "1"
        assert unseen.json()["error"]["type"] == "service_unavailable_error"
        assert unseen.json()["error"]["message"].startswith("cannot verify this API key: it has not been used "
                                                            "on this router before and the API key store (Redis) "
                                                            "is unavailable")
        assert refusals("key_store_unavailable") == before + 1
        anthropic = await call(tiny, key=OTHER, path="/v1/messages").run()
        assert anthropic.status == 503 and anthropic.json()["error"]["type"] == "overloaded_error"
        store.is_down = False
        assert (await call(tiny, key=OTHER).run()).status == 200
        assert (await call(tiny, key="epd-wrong").run()).status == 401
    asyncio.run(test())
    assert tiny.tenants == ["acme"] * 8


def test_a_revoke_reaches_the_router_within_the_ttl():
    clock = FakeClock()
    tiny, store, _ = make_tiny(clock)

    async def test():
        assert (await call(tiny).run()).status == 200
        await store.revoke(hash_key(GOOD)[:12])  # through another router
        clock.advance(TTL_S - 0.1)
        assert (await call(tiny).run()).status == 200
        clock.advance(0.1)
        assert (await call(tiny).run()).status == 403
        revoked = await tiny.gate.store.revoke(hash_key(OTHER)[:12])  # through this one: at once
        assert revoked.revoked and (await call(tiny, key=OTHER).run()).status == 403
    asyncio.run(test())


def test_fail_open_admits_under_this_routers_own_buckets_and_logs_once(caplog):
    clock = FakeClock()
    tiny, _, limiter = make_tiny(clock)
    local_before = LIMITS_DEGRADED.labels("local")._value.get()

    async def test():
        assert (await call(tiny, key=LIMITED).run()).status == 200
        limiter.is_down = True
        # The shared bucket has 1 request left; this router's own starts full: 2 more pass.
        assert [(await call(tiny, key=LIMITED).run()).status for _ in range(3)] == [200, 200, 429]
        assert (await call(tiny).run()).status == 200  # a key without limits never asks
        limiter.is_down = False
        assert (await call(tiny, key=LIMITED).run()).status == 200
        assert (await call(tiny, key=LIMITED).run()).status == 429
    with caplog.at_level(logging.WARNING, "services.router.access.redis_access"):
        asyncio.run(test())
    assert LIMITS_DEGRADED.labels("local")._value.get() == local_before + 3
    assert limiter.failed == {"acquire": 3}
    assert sum("per-key limits cannot be checked" in r.message for r in caplog.records) == 1
    assert "fail-open" in caplog.text


def test_fail_open_leases_go_back_to_the_local_limiter():
    clock = FakeClock()
    tiny, _, limiter = make_tiny(clock)

    async def test():
        limiter.is_down = True
        held = call(tiny, key=HELD, body={"hold": True}).start()
        await held.first_body.wait()
        assert (await call(tiny, key=HELD).run()).status == 429  # this router's own concurrency count
        tiny.release.set()
        await held.task
        assert await tiny.gate.limiter.local.num_in_flight(hash_key(HELD)) == 0
        assert (await call(tiny, key=HELD).run()).status == 200
    asyncio.run(test())
    assert "release" not in limiter.failed  # local leases never went near Redis


@pytest.mark.parametrize("path, error_type", [("/v1/chat/completions", "service_unavailable_error"),
                                              ("/v1/messages", "overloaded_error")])
def test_fail_closed_is_503_with_retry_after_in_each_protocols_body(path, error_type):
    clock = FakeClock()
    tiny, _, limiter = make_tiny(clock, fail_open=False)
    before = refusals("limits_unavailable", path)

    async def test():
        limiter.is_down = True
        refused = await call(tiny, key=LIMITED, path=path).run()
        assert refused.status == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == error_type
        assert "the per-key limits store (Redis) is unavailable" in refused.json()["error"]["message"]
        assert (await call(tiny, path=path).run()).status == 200  # no limits: nothing to check
        limiter.is_down = False
        assert (await call(tiny, key=LIMITED, path=path).run()).status == 200
    asyncio.run(test())
    assert refusals("limits_unavailable", path) == before + 1
    assert tiny.bodies == [b"{}", b"{}"]


def test_a_release_or_renewal_that_fails_never_reaches_the_request():
    clock = FakeClock()
    tiny, _, limiter = make_tiny(clock, renew_every_s=0.001)
    failed_before = {what: LIMITS_DEGRADED.labels(what)._value.get() for what in ("release", "renew")}

    async def test():
        held = call(tiny, key=HELD, body={"hold": True}).start()
        await held.first_body.wait()
        limiter.is_down = True
        while "renew" not in limiter.failed:
            await asyncio.sleep(0.001)
        tiny.release.set()
        await held.task
        assert held.reply().status == 200 and held.reply().body == b"firstrest"
    asyncio.run(test())
    assert limiter.failed["release"] == 1
    assert LIMITS_DEGRADED.labels("release")._value.get() == failed_before["release"] + 1
    assert LIMITS_DEGRADED.labels("renew")._value.get() > failed_before["renew"]


def test_a_dead_redis_fails_a_call_fast_and_then_is_skipped():
    """The real adapters over a port nobody listens on: a refusal in well under the deadline,
    then the breaker answers without touching the network until the next probe."""
    import time

    from services.common.redis_link import RedisHealth, async_client
    from services.router.access.redis_access import RedisKeyStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def test():
        client = async_client(f"redis://127.0.0.1:{port}/0")
        health = RedisHealth("test")
        store = CachedKeyStore(RedisKeyStore(client, health=health))
        try:
            started = time.monotonic()
            with pytest.raises(UnavailableError, match="cannot verify this API key"):
                await store.find("ab" * 32)
            assert time.monotonic() - started < 5.0  # generous: about 0.15 s of retries here
            assert not health.is_available and health.num_outages == 1
            with pytest.raises(UnavailableError, match="next try in"):
                await store.find("ab" * 32)
        finally:
            await store.close()
    asyncio.run(test())


def test_the_redis_failure_settings_are_flags_and_env_vars():
    config = parse_config(RouterConfig, ["--limits-on-redis-failure", "fail-closed"], "router",
                          env={"EPD_ROUTER_KEY_CACHE_TTL_S": "2.5"})
    assert config.limits_on_redis_failure == "fail-closed" and config.key_cache_ttl_s == 2.5
    config = parse_config(RouterConfig, [], "router", env={"EPD_ROUTER_LIMITS_ON_REDIS_FAILURE": "fail-closed"})
    assert config.limits_on_redis_failure == "fail-closed"
    assert RouterConfig().limits_on_redis_failure == "fail-open"
    with pytest.raises(ConfigError, match="--limits-on-redis-failure / EPD_ROUTER_LIMITS_ON_REDIS_FAILURE: "
                                          "must be fail-open or fail-closed"):
        parse_config(RouterConfig, ["--limits-on-redis-failure", "open"], "router", env={})
    with pytest.raises(ConfigError, match="--key-cache-ttl-s / EPD_ROUTER_KEY_CACHE_TTL_S: must be > 0"):
        parse_config(RouterConfig, ["--key-cache-ttl-s", "0"], "router", env={})


def test_a_router_restarted_while_redis_is_down_starts_and_serves_its_configured_keys(monkeypatch, redis_url):
    """At a first start an unreachable Redis is most likely a wrong URL: the router refuses to
    start. Restarted by its supervisor (EPD_RESTART_COUNT), it is an outage: it starts, its
    configured keys work, other keys and (without keys) every caller get 503 until Redis
    answers, and then the configured keys are written there."""
    import redis as redis_py

    from services.common.metrics import RESTART_COUNT_ENV
    from services.router.access.gate import build_gate
    from tests.unit.router.gate_fakes import Call

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    with pytest.raises(ConfigError, match="--redis-url"):
        asyncio.run(build_gate(RouterConfig(redis_url=dead, api_keys=(f"acme:{GOOD}",))))
    monkeypatch.setenv(RESTART_COUNT_ENV, "1")

    async def restarted(url: str, keys: tuple[str, ...]) -> list[int]:
        gate = await build_gate(RouterConfig(redis_url=url, api_keys=keys))
        try:
            app = TinyApp(gate).app()
            statuses = [(await Call(app, "/v1/chat/completions", bearer(key) if key else {}, b"{}").run()).status
                        for key in (GOOD, OTHER, None)]
            if url != dead:  # Redis is there: the configured key reaches it by itself
                for _ in range(50):
                    if await gate.store.store.find(hash_key(GOOD)) is not None:
                        break
                    await asyncio.sleep(0.1)
            return statuses
        finally:
            await gate.close()

    assert asyncio.run(restarted(dead, (f"acme:{GOOD}",))) == [200, 503, 401]
    assert asyncio.run(restarted(dead, ())) == [503, 503, 503]
    client = redis_py.Redis.from_url(redis_url)
    try:
        client.flushdb()
        assert asyncio.run(restarted(redis_url, (f"acme:{GOOD}",))) == [200, 401, 401]
        assert any(b"router" in k for k in client.keys("*"))
    finally:
        client.flushdb()
        client.close()
