"""RedisHealth: an outage is logged and counted once, calls are skipped until the next probe
(back-off up to PROBE_MAX_S), a success ends it; and the clients are built to fail fast."""

from __future__ import annotations

import logging

import pytest
import redis

from services.common import redis_link
from services.common.redis_link import OUTAGES, PROBE_BASE_S, PROBE_MAX_S, RedisHealth, RedisSkipped
from tests.factories import ManualClock


def fail(health: RedisHealth, error: Exception = redis.ConnectionError("connection refused")) -> None:
    with pytest.raises(type(error)):
        with health.guard():
            raise error


def test_an_outage_is_logged_and_counted_once_and_calls_wait_for_the_probe(caplog):
    clock = ManualClock(100.0)
    health = RedisHealth("test", clock, rng=lambda: 1.0)
    before = OUTAGES._value.get()
    with caplog.at_level(logging.WARNING, "services.common.redis_link"):
        with health.guard():
            pass
        fail(health)
        assert not health.is_available and health.down_since == 100.0
        with pytest.raises(RedisSkipped, match="next try in"):
            with health.guard():
                raise AssertionError("a skipped call must not run")
        clock.now = health._next_probe_at
        with pytest.raises(redis.ConnectionError):
            with health.guard():  # the probe: calls meanwhile are still skipped
                with pytest.raises(RedisSkipped):
                    with health.guard():
                        pass
                raise redis.ConnectionError("connection refused")
        probes = []
        for _ in range(8):  # each failed probe waits longer, up to PROBE_MAX_S
            clock.now = health._next_probe_at
            fail(health)
            probes.append(health._next_probe_at - clock.now)
        assert probes == sorted(probes) and probes[0] >= PROBE_BASE_S and probes[-1] == PROBE_MAX_S
        clock.now = health._next_probe_at
        with health.guard():
            pass
    assert health.is_available and health.is_worth_trying()
    assert health.num_outages == 1 and OUTAGES._value.get() == before + 1
    assert [r.message for r in caplog.records if "Redis" in r.message] == [
        "test: Redis is unavailable (connection refused); degrading until it is back",
        f"test: Redis is back after {clock.now - 100.0:.1f} s"]


def test_a_command_error_is_not_an_outage():
    health = RedisHealth("test", ManualClock())
    fail(health, redis.ResponseError("WRONGTYPE"))
    assert health.is_available and health.num_outages == 0
    fail(health, redis.TimeoutError("Timeout reading from socket"))
    assert not health.is_available
    health.clock.now += PROBE_MAX_S
    fail(health, redis.ResponseError("NOSCRIPT"))  # an answer, if not the one hoped for
    assert health.is_available and health.num_outages == 1


def test_clients_fail_fast_and_retry_only_refused_connections():
    for client in (redis_link.sync_client("redis://127.0.0.1:1/0"), redis_link.async_client("redis://127.0.0.1:1/0")):
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["socket_connect_timeout"] == redis_link.CONNECT_TIMEOUT_S <= 1.0
        assert kwargs["socket_timeout"] == redis_link.SOCKET_TIMEOUT_S <= 1.0
        retry = kwargs["retry"]
        assert retry.get_retries() == redis_link.NUM_RETRIES
        assert retry._supported_errors == (redis.ConnectionError,)
