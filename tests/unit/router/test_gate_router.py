"""The gate on the real router app (scripted backend, real HTTP, the official SDKs), and how the
router decides at start whether its API needs keys."""

from __future__ import annotations

import asyncio
import logging
import threading

import anthropic
import httpx
import openai
import pytest

from services.common.config import ConfigError, parse_config
from services.router.access.auth import ApiKey, FileKeyStore, hash_key
from services.router.config import RouterConfig
from services.router.access.gate import REFUSALS, Gate, build_gate, open_without_keys
from services.router.api.app import create_app
from services.router.access.limits import Lease, Limits, LocalLimiter
from tests.unit.router.conftest import SCRIPT_TEXT
from tests.unit.router.fakes import ServerThread

KEY, SLOW_KEY = "epd-router-test", "epd-slow"
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5}


class RecordingLimiter(LocalLimiter):
    """Remembers the tokens each release charged; ``released`` is set by every release."""

    def __init__(self) -> None:
        super().__init__()
        self.charged: list[int] = []
        self.released = threading.Event()

    async def release(self, lease: Lease, num_tokens: int) -> None:
        await super().release(lease, num_tokens)
        self.charged.append(num_tokens)
        self.released.set()


@pytest.fixture
def gated(make_backend):
    """(base URL, limiter, backend): the router app behind a gate with KEY (tpm 10^6) and
    SLOW_KEY (one request at a time), over a backend slow enough to leave mid-stream."""
    store = FileKeyStore(None)
    asyncio.run(store.add(ApiKey(hash_key(KEY), "acme", tpm=1_000_000)))
    asyncio.run(store.add(ApiKey(hash_key(SLOW_KEY), "acme", max_concurrency=1)))
    limiter = RecordingLimiter()
    backend = make_backend(SCRIPT_TEXT * 20, delay_s=0.02)
    with ServerThread(create_app(backend, gate=Gate(store, limiter, Limits(), max_body_bytes=1000))) as server:
        yield server.url, limiter, backend


def test_the_official_sdks_authenticate(gated):
    url, limiter, _ = gated
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=10) as client:
        reply = client.chat.completions.create(**CHAT)
    # The route's count reaches the tpm bucket when the response has gone out: wait for it.
    assert limiter.released.wait(5) and limiter.charged == [reply.usage.total_tokens]
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=10) as client:
        assert client.models.retrieve("test-model").id == "test-model"
    refused = REFUSALS.labels("/v1/models/{model}", "unknown_key")._value.get()
    with openai.OpenAI(base_url=f"{url}/v1", api_key="epd-wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(**CHAT)
        with pytest.raises(openai.AuthenticationError):
            client.models.retrieve("test-model")
    assert REFUSALS.labels("/v1/models/{model}", "unknown_key")._value.get() == refused + 1
    with anthropic.Anthropic(base_url=url, api_key=None, default_headers={"Authorization": anthropic.Omit()},
                             max_retries=0) as claude:
        with pytest.raises(anthropic.AuthenticationError):
            claude.messages.create(model="test-model", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    limiter.released.clear()
    with anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=10) as claude:  # x-api-key
        message = claude.messages.create(model="test-model", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    assert limiter.released.wait(5) and limiter.charged[-1] == message.usage.input_tokens + message.usage.output_tokens
    assert httpx.get(url + "/health").status_code == 200


def test_a_client_leaving_mid_stream_frees_its_slot(gated):
    url, limiter, backend = gated
    with httpx.Client(timeout=10, headers={"Authorization": f"Bearer {SLOW_KEY}"}) as client:
        with client.stream("POST", url + "/v1/chat/completions", json={**CHAT, "max_tokens": 500, "stream": True}) as held:
            assert held.status_code == 200
            next(held.iter_lines())
            refused = client.post(url + "/v1/chat/completions", json=CHAT)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert limiter.released.wait(5), "the slot was not released after the client left"
    assert backend.closed == [backend.requests[0].request_id]
    assert asyncio.run(limiter.num_in_flight(hash_key(SLOW_KEY))) == 0
    with httpx.Client(timeout=10, headers={"Authorization": f"Bearer {SLOW_KEY}"}) as client:
        assert client.post(url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_bodies_over_the_limit_are_413_over_http(gated):
    url, _, _ = gated
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    declared = httpx.post(url + "/v1/chat/completions", headers=headers, content=b" " * 1500)
    assert declared.status_code == 413 and "has 1500 bytes (Content-Length)" in declared.json()["error"]["message"]
    chunked = httpx.post(url + "/v1/messages", headers=headers, content=iter([b" " * 600, b" " * 600]))
    assert chunked.status_code == 413
    assert chunked.json()["type"] == "error" and chunked.json()["error"]["type"] == "request_too_large"
    assert "at least 1200 bytes; this server accepts at most 1000 bytes" in chunked.json()["error"]["message"]


def test_the_first_key_made_through_the_admin_api_turns_keys_on(tmp_path, backend):
    from services.router.admin.app import create_admin_app

    gate = build(api_keys_file=str(tmp_path / "keys.json"))  # a new file: no keys, open on loopback
    with ServerThread(create_app(backend, gate=gate)) as router, \
            ServerThread(create_admin_app({}, "admin-token", keys=gate.store)) as admin:
        assert httpx.post(router.url + "/v1/chat/completions", json=CHAT).status_code == 200
        created = httpx.post(admin.url + "/admin/keys", json={"tenant": "acme"},
                             headers={"Authorization": "Bearer admin-token"})
        assert created.status_code == 200
        assert httpx.post(router.url + "/v1/chat/completions", json=CHAT).status_code == 401
        with_key = httpx.post(router.url + "/v1/chat/completions", json=CHAT,
                              headers={"Authorization": f"Bearer {created.json()['key']}"})
        assert with_key.status_code == 200
    assert created.json()["key"] not in (tmp_path / "keys.json").read_text()


@pytest.mark.parametrize("host, has_keys, has_store, allowed, expected", [
    ("127.0.0.1", False, False, False, True), ("::1", False, False, False, True),
    ("localhost", False, True, False, True), ("0.0.0.0", True, False, False, False),
    ("0.0.0.0", False, True, False, False), ("10.1.2.3", False, False, True, True),
    ("0.0.0.0", False, False, False, None), ("", False, False, False, None)])
def test_open_access_only_on_loopback_unless_allowed(host, has_keys, has_store, allowed, expected):
    if expected is None:
        with pytest.raises(ConfigError, match="--allow-unauthenticated"):
            open_without_keys(host, has_keys, has_store, allowed)
    else:
        assert open_without_keys(host, has_keys, has_store, allowed) is expected


def build(**settings) -> Gate:
    async def make():
        gate = await build_gate(RouterConfig(**settings))
        await gate.close()
        return gate
    return asyncio.run(make())


def test_the_router_starts_open_on_loopback_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, "services.router.access.gate"):
        gate = build()
    assert gate.is_open_without_keys and not gate.store.is_persistent
    assert "open to anyone who can reach it on this machine" in caplog.text
    assert "epd admin keys create" in caplog.text


def test_beyond_loopback_an_empty_keys_file_starts_closed(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, "services.router.access.gate"):
        gate = build(host="0.0.0.0", api_keys_file=str(tmp_path / "keys.json"), rpm=5, max_body_bytes=99)
    assert not gate.is_open_without_keys and "every API request gets 401" in caplog.text
    assert gate.default_limits == Limits(rpm=5) and gate.max_body_bytes == 99


def test_a_broken_keys_file_stops_the_start(tmp_path):
    broken = tmp_path / "keys.json"
    broken.write_text("[")
    with pytest.raises(ConfigError, match="--api-keys-file / EPD_ROUTER_API_KEYS_FILE: .* not an epd keys file"):
        build(api_keys_file=str(broken))


def test_configured_keys_are_seeded_and_bad_ones_are_not_echoed():
    gate = build(host="0.0.0.0", api_keys=("sk-one", "acme:sk-two"))
    assert asyncio.run(gate.store.find(hash_key("sk-two"))).tenant == "acme"
    with pytest.raises(ConfigError) as bad:
        build(api_keys=("bad tenant:sk-secret",))
    assert "EPD_ROUTER_API_KEYS" in str(bad.value) and "sk-secret" not in str(bad.value)


def test_redis_holds_the_keys_when_configured(redis_url):
    from services.router.access.key_cache import CachedKeyStore
    from services.router.access.redis_access import DegradingLimiter, RedisKeyStore, RedisLimiter, redacted

    gate = build(host="0.0.0.0", redis_url=redis_url)
    assert isinstance(gate.store, CachedKeyStore) and isinstance(gate.store.store, RedisKeyStore)
    assert isinstance(gate.limiter, DegradingLimiter) and isinstance(gate.limiter.shared, RedisLimiter)
    assert gate.limiter.fail_open and gate.limiter.shared.health is gate.store.store.health
    assert not build(redis_url=redis_url, limits_on_redis_failure="fail-closed").limiter.fail_open
    assert redacted("redis://user:secret@db.example:6380/2") == "redis://db.example:6380/2"
    with pytest.raises(ConfigError, match="--redis-url / EPD_ROUTER_REDIS_URL: the API key store"):
        build(redis_url=redis_url.replace("127.0.0.1", "user:secret@127.0.0.1"))


def test_a_router_that_may_not_start_exits_before_connecting(caplog):
    from services.router.__main__ import run

    # The prefill address is never dialled: the key check comes first.
    assert asyncio.run(run(RouterConfig(host="0.0.0.0", prefill=("127.0.0.1:1",)))) == 2
    assert "beyond this machine" in caplog.text


def test_key_settings_are_flags_and_env_vars():
    config = parse_config(RouterConfig, ["--rpm", "60", "--allow-unauthenticated"], "router",
                          env={"EPD_ROUTER_API_KEYS": "k1,acme:k2", "EPD_ROUTER_MAX_BODY_BYTES": "2048"})
    assert config.api_keys == ("k1", "acme:k2") and config.rpm == 60 and config.max_body_bytes == 2048
    assert config.allow_unauthenticated
    with pytest.raises(ConfigError, match="--tpm / EPD_ROUTER_TPM: must be >= 0"):
        parse_config(RouterConfig, ["--tpm", "-1"], "router", env={})
    with pytest.raises(ConfigError, match="--api-keys-file / EPD_ROUTER_API_KEYS_FILE: is a second key store"):
        parse_config(RouterConfig, ["--api-keys-file", "k.json", "--redis-url", "redis://x"], "router", env={})
