"""API keys on a live cluster: two real routers sharing one real Redis enforce one limit between
them, a key given to ``epd up``, or created through one router's admin API, counts on the other
at once (a revoke within the routers' key cache TTL), and the official SDKs see their own
authentication errors."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest
import redis

from services.launcher import free_port
from tests.cluster import running_cluster

TOKEN = "test-admin-token"
SEEDED_KEY = "epd-given-to-epd-up"
CHAT = {"model": "tiny-chat0", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
KEY_CACHE_TTL_S = 1.0
"""How long a router trusts a key it read from Redis (--key-cache-ttl-s): a revoke lands within it."""


def start_router(prefill: str, decode: str, redis_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port("127.0.0.1")
    process = subprocess.Popen([sys.executable, "-m", "services.router", "--port", str(port), "--prefill", prefill,
                                "--decode", decode, "--admin-port", "none", "--redis-url", redis_url])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the second router exited with {process.returncode}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # polling a process that is starting: there is nothing to wait on
    process.kill()
    raise AssertionError("the second router did not become healthy")


@pytest.fixture(scope="module")
def routers(tiny_chat_model_dir, redis_url):
    """(first router's URL, second router's URL, admin URL of the first): one cluster, two routers."""
    redis.Redis.from_url(redis_url).flushdb()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EPD_ROUTER_KEY_CACHE_TTL_S", str(KEY_CACHE_TTL_S))  # both routers inherit it
        with running_cluster(str(tiny_chat_model_dir), encoders=0, prefills=1, decodes=1, kv_cache_gib=0.05,
                             max_num_batched_tokens=64, device="cpu", kvstores=0, redis=redis_url,
                             admin_token=TOKEN, api_key=(f"seeded:{SEEDED_KEY}",)) as running:
            assert running.cluster.needs_keys  # what the banner reports, asked of the router
            second, second_url = start_router(running.addresses("prefill")[0], running.addresses("decode")[0],
                                              redis_url)
            try:
                yield running.url, second_url, f"http://127.0.0.1:{running.cluster.config.admin_port}"
            finally:
                second.terminate()
                second.wait(30)
                redis.Redis.from_url(redis_url).flushdb()  # keys left behind would close later tests' clusters


def refused_once_the_cache_expires(url: str, key: str) -> int:
    """The status a revoked key gets from a router that may still hold it in its key cache."""
    deadline = time.monotonic() + KEY_CACHE_TTL_S + 10  # generous: the TTL, plus a loaded machine
    while (status := chat(url, key).status_code) not in (401, 403) and time.monotonic() < deadline:
        time.sleep(0.1)  # waiting out the cache's TTL: no event to wait on
    return status


def create_key(admin_url: str, **body) -> dict:
    reply = httpx.post(admin_url + "/admin/keys", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()


def chat(url: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60)


def test_two_routers_share_keys_and_one_limit(routers):
    first, second, admin_url = routers
    assert [chat(url, None).status_code for url in (first, second)] == [401, 401]
    assert chat(second, SEEDED_KEY).status_code == 200  # epd up -> router 1's env -> Redis -> router 2
    limited = create_key(admin_url, tenant="acme", rpm=5)
    urls = [first, second] * 6
    with concurrent.futures.ThreadPoolExecutor(12) as pool:  # all admitted well within the 12 s refill
        replies = list(pool.map(lambda url: chat(url, limited["key"]), urls))
    statuses = [r.status_code for r in replies]
    assert sorted(statuses) == [200] * 5 + [429] * 7, [r.text for r in replies]
    for reply in replies:
        if reply.status_code == 429:
            assert 1 <= int(reply.headers["retry-after"]) <= 12
            assert "5 requests per minute" in reply.json()["error"]["message"]
    revoked = httpx.post(f"{admin_url}/admin/keys/{limited['id']}/revoke",
                         headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert revoked.status_code == 200 and revoked.json()["revoked"]
    assert refused_once_the_cache_expires(second, limited["key"]) == 403  # revoked on one, refused on the other


def test_the_sdks_see_authentication_errors(routers):
    first, second, admin_url = routers
    key = create_key(admin_url, tenant="sdk")["key"]
    with openai.OpenAI(base_url=f"{second}/v1", api_key="epd-wrong", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(**CHAT)
    with openai.OpenAI(base_url=f"{second}/v1", api_key=key, max_retries=0, timeout=60) as client:
        assert client.chat.completions.create(**CHAT).usage.completion_tokens >= 1
    with anthropic.Anthropic(base_url=first, api_key=None, default_headers={"Authorization": anthropic.Omit()},
                             max_retries=0, timeout=60) as claude:
        with pytest.raises(anthropic.AuthenticationError):
            claude.messages.create(model="tiny-chat0", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    with anthropic.Anthropic(base_url=first, api_key=key, max_retries=0, timeout=60) as claude:
        message = claude.messages.create(model="tiny-chat0", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert message.usage.output_tokens >= 1


def test_the_sdks_see_every_refusal_in_their_own_format(routers):
    first, second, admin_url = routers
    limited = create_key(admin_url, tenant="sdk-limits", rpm=1)
    with openai.OpenAI(base_url=f"{first}/v1", api_key=limited["key"], max_retries=0, timeout=60) as client:
        client.chat.completions.create(**CHAT)
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(**CHAT)
        assert int(info.value.response.headers["retry-after"]) >= 1 and info.value.body["type"] == "rate_limit_error"
    with anthropic.Anthropic(base_url=second, api_key=limited["key"], max_retries=0, timeout=60) as claude:
        with pytest.raises(anthropic.RateLimitError) as info:  # the limit is shared: router 2 refuses too
            claude.messages.create(model="tiny-chat0", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert info.value.body["error"]["type"] == "rate_limit_error"
    httpx.post(f"{admin_url}/admin/keys/{limited['id']}/revoke", headers={"Authorization": f"Bearer {TOKEN}"},
               timeout=10).raise_for_status()
    assert refused_once_the_cache_expires(second, limited["key"]) == 403
    with openai.OpenAI(base_url=f"{second}/v1", api_key=limited["key"], max_retries=0, timeout=60) as client:
        with pytest.raises(openai.PermissionDeniedError):
            client.chat.completions.create(**CHAT)
    key = create_key(admin_url, tenant="sdk-big")["key"]
    huge = [{"role": "user", "content": "x" * (17 * 1024 * 1024)}]
    with openai.OpenAI(base_url=f"{first}/v1", api_key=key, max_retries=0, timeout=60) as client:
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model="tiny-chat0", messages=huge, max_tokens=2)
        assert info.value.status_code == 413 and "bytes" in info.value.body["message"]
    with anthropic.Anthropic(base_url=first, api_key=key, max_retries=0, timeout=60) as claude:
        with pytest.raises(anthropic.APIStatusError) as info:
            claude.messages.create(model="tiny-chat0", max_tokens=2, messages=huge)
        assert info.value.status_code == 413 and info.value.body["error"]["type"] == "request_too_large"


def test_tenants_never_share_cached_prefixes(routers):
    first, _, admin_url = routers
    keys = {tenant: create_key(admin_url, tenant=tenant)["key"] for tenant in ("tenant-a", "tenant-b")}
    prompt = [{"role": "user", "content": "A prompt long enough to fill several KV blocks. " * 12}]

    def cached(tenant: str) -> int:
        with openai.OpenAI(base_url=f"{first}/v1", api_key=keys[tenant], max_retries=0, timeout=60) as client:
            reply = client.chat.completions.create(model="tiny-chat0", messages=prompt, max_tokens=2, temperature=0)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # the same prompt, another tenant: no hit
    assert cached("tenant-a") > 0  # its own tenant hits
