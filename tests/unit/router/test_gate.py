"""The gate in front of a tiny app: keys, limits with Retry-After, body sizes, error bodies in the
path's protocol, and no concurrency slot left behind however a request ends."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.errors import UnavailableError
from services.router.access.auth import ApiKey, FileKeyStore, hash_key
from services.router.access.gate import Gate
from services.router.access.limits import Limits, LocalLimiter
from tests.unit.router.gate_fakes import GENERATION_PATHS, Call, FakeClock, TinyApp, bearer

GOOD, LIMITED, REVOKED, HELD = "epd-good", "epd-limited", "epd-revoked", "epd-held"


def make_tiny(clock: FakeClock | None = None, *, max_body_bytes: int = 1000, is_open: bool = True,
              keys: bool = True) -> TinyApp:
    store = FileKeyStore(None)
    if keys:
        for key in (ApiKey(hash_key(GOOD), "acme"), ApiKey(hash_key(LIMITED), "beta", rpm=2, tpm=100),
                    ApiKey(hash_key(REVOKED), "acme", revoked=True), ApiKey(hash_key(HELD), "gamma", max_concurrency=1)):
            asyncio.run(store.add(key))
    return TinyApp(Gate(store, LocalLimiter(clock or FakeClock()), Limits(), max_body_bytes, is_open))


def run(test) -> None:
    asyncio.run(test())


def call(tiny: TinyApp, path: str = "/v1/chat/completions", key: str | None = GOOD, body: dict | None = None,
         **kwargs) -> Call:
    headers = {**(bearer(key) if key else {}), **kwargs.pop("headers", {})}
    return Call(tiny.app(), path, headers, json.dumps(body or {}).encode(), **kwargs)


def test_a_good_key_passes_with_its_tenant_either_header():
    tiny = make_tiny()

    async def test():
        assert (await call(tiny).run()).status == 200
        assert (await call(tiny, key=None, headers={"x-api-key": GOOD}).run()).status == 200
        assert (await call(tiny, "/v1/models", method="GET").run()).status == 200
    run(test)
    assert tiny.tenants == ["acme", "acme"]


@pytest.mark.parametrize("headers, reason", [({}, "an API key is required"),
                                             ({"Authorization": "Bearer epd-wrong"}, "invalid API key"),
                                             ({"x-api-key": "epd-wrong"}, "invalid API key"),
                                             ({"Authorization": "Basic " + GOOD}, "an API key is required")])
def test_no_key_or_a_wrong_one_is_401_in_each_protocols_body(headers, reason):
    tiny = make_tiny()

    async def test():
        for path in GENERATION_PATHS + ("/v1/models",):
            reply = await call(tiny, path, key=None, headers=headers, method="GET" if path == "/v1/models" else "POST").run()
            assert reply.status == 401 and reply.headers["www-authenticate"] == "Bearer"
            if path.startswith("/v1/messages"):
                assert reply.json() == {"type": "error", "error": {"type": "authentication_error",
                                                                   "message": reply.json()["error"]["message"]}}
            else:
                assert reply.json()["error"]["type"] == "authentication_error"
                assert reply.json()["error"]["code"] == "invalid_api_key"
            assert reason in reply.json()["error"]["message"]
    run(test)
    assert tiny.bodies == []


def test_a_revoked_key_is_403():
    tiny = make_tiny()
    reply = asyncio.run(call(tiny, "/v1/messages", key=REVOKED).run())
    assert reply.status == 403
    assert reply.json()["error"] == {"type": "permission_error",
                                     "message": f"API key {hash_key(REVOKED)[:12]} has been revoked"}


def test_health_and_metrics_stay_open_and_nothing_else_does():
    tiny = make_tiny()

    async def test():
        for path in ("/health", "/metrics"):
            assert (await Call(tiny.app(), path, method="GET").run()).status == 200
        for path in ("/v1/embeddings", "/docs", "/health/"):  # a route added later is gated too
            assert (await Call(tiny.app(), path, method="GET").run()).status == 401
        assert (await call(tiny, "/v1/embeddings").run()).status == 404  # with a key: the app's answer
    run(test)


def test_requests_per_minute_429_with_retry_after():
    clock = FakeClock()
    tiny = make_tiny(clock)

    async def test():
        assert [(await call(tiny, key=LIMITED).run()).status for _ in range(2)] == [200, 200]
        refused = await call(tiny, key=LIMITED).run()
        assert refused.status == 429 and refused.headers["retry-after"] == "30"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert "2 requests per minute" in refused.json()["error"]["message"]
        anthropic = await call(tiny, "/v1/messages", key=LIMITED).run()
        assert anthropic.json()["type"] == "error" and anthropic.json()["error"]["type"] == "rate_limit_error"
        assert (await call(tiny).run()).status == 200  # another key is not limited by this one
        clock.advance(30)
        assert (await call(tiny, key=LIMITED).run()).status == 200
    run(test)


def test_tokens_are_charged_when_the_request_ends():
    clock = FakeClock()
    tiny = make_tiny(clock)

    async def test():
        assert (await call(tiny, key=LIMITED, body={"tokens": 150}).run()).status == 200
        refused = await call(tiny, key=LIMITED).run()  # 100 - 150: 50 in debt, 30 s to repay, positive after
        assert refused.status == 429 and refused.headers["retry-after"] == "31"
        assert "100 tokens per minute" in refused.json()["error"]["message"]
        clock.advance(31)
        assert (await call(tiny, key=LIMITED).run()).status == 200
    run(test)


def test_concurrency_limit_holds_while_a_stream_is_open():
    tiny = make_tiny()

    async def test():
        held = call(tiny, key=HELD, body={"hold": True}).start()
        await held.first_body.wait()
        refused = await call(tiny, key=HELD).run()
        assert refused.status == 429 and refused.headers["retry-after"] == "1"
        assert "1 requests in flight at once" in refused.json()["error"]["message"]
        assert await tiny.gate.limiter.num_in_flight(hash_key(HELD)) == 1
        tiny.release.set()
        await held.task
        assert held.reply().body == b"firstrest"
        assert await tiny.gate.limiter.num_in_flight(hash_key(HELD)) == 0
        assert (await call(tiny, key=HELD).run()).status == 200
    run(test)


@pytest.mark.parametrize("ending", ["disconnect", "exception", "cancelled", "disconnect_before_body"])
def test_no_slot_leaks_however_the_request_ends(ending):
    tiny = make_tiny()

    async def test():
        if ending == "exception":
            failing = call(tiny, key=HELD, body={"fail": True})
            with pytest.raises(RuntimeError, match="the app failed"):
                await failing.run()
            assert failing.reply().status == 500
        elif ending == "disconnect_before_body":
            leaving = call(tiny, key=HELD, chunks=[b"{"], leaves_mid_body=True)
            await leaving.start().task
            assert leaving.sent == [] and tiny.bodies == []
        else:
            held = call(tiny, key=HELD, body={"hold": True}).start()
            await held.first_body.wait()
            assert await tiny.gate.limiter.num_in_flight(hash_key(HELD)) == 1
            if ending == "disconnect":
                held.disconnect()
                await held.task
            else:
                held.task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await held.task
        assert await tiny.gate.limiter.num_in_flight(hash_key(HELD)) == 0
    run(test)


def test_body_too_large_by_content_length_is_refused_unread():
    tiny = make_tiny(max_body_bytes=10)

    async def test():
        big = call(tiny, "/v1/messages", body={"text": "x" * 23})  # 35 bytes of JSON
        reply = await big.run()
        assert reply.status == 413 and big.num_received == 0
        assert reply.json()["error"]["type"] == "request_too_large"
        assert reply.json()["error"]["message"] == ("the request body has 35 bytes (Content-Length); this server "
                                                    "accepts at most 10 bytes (--max-body-bytes)")
    run(test)


def test_chunked_body_is_counted_as_it_arrives():
    tiny = make_tiny(max_body_bytes=20)

    async def test():
        chunked = call(tiny, key=HELD, chunks=[b"0123456789", b"0123456789x", b"never read"])
        reply = await chunked.run()
        assert reply.status == 413 and chunked.num_received == 2
        assert "has at least 21 bytes; this server accepts at most 20 bytes" in reply.json()["error"]["message"]
        assert await tiny.gate.limiter.num_in_flight(hash_key(HELD)) == 0
        fits = await call(tiny, chunks=[b'{"to', b'kens"', b": 1}"]).run()
        assert fits.status == 200
    run(test)
    assert tiny.bodies == [b'{"tokens": 1}']


def test_while_no_key_exists_the_gate_is_open_until_the_first_one_is_added():
    tiny = make_tiny(keys=False)

    async def test():
        assert (await call(tiny, key=None).run()).status == 200
        await tiny.gate.store.add(ApiKey(hash_key(GOOD), "acme"))
        assert (await call(tiny, key=None).run()).status == 401
        assert (await call(tiny).run()).status == 200
    run(test)
    assert tiny.tenants == [None, "acme"]


def test_a_closed_gate_refuses_everyone_while_no_key_exists():
    tiny = make_tiny(keys=False, is_open=False)
    reply = asyncio.run(call(tiny, key="epd-anything").run())
    assert reply.status == 401 and tiny.bodies == []


def test_an_unreachable_key_store_is_503_not_open_access():
    class DownStore(FileKeyStore):
        async def has_keys(self) -> bool:
            raise UnavailableError("the API key store (Redis) is unavailable: connection refused")

    tiny = TinyApp(Gate(DownStore(None), LocalLimiter()))
    reply = asyncio.run(call(tiny).run())
    assert reply.status == 503 and "unavailable" in reply.json()["error"]["message"] and tiny.bodies == []
