"""The gate in front of the public API: API key, per-key limits and body size, before any route runs.

A pure ASGI middleware (streaming responses and disconnects pass through untouched) on every
path but /health and /metrics (the generation paths, /v1/models and /v1/models/{model}, any route
added later). Life of a gated request::

    key (Authorization: Bearer KEY, or x-api-key: KEY)  -- none / unknown: 401, revoked: 403,
                                                             cannot be verified (Redis down): 503
    Content-Length over max_body_bytes                    -- 413
    limiter.acquire(key, limits)                          -- over rpm / tpm / concurrency: 429 + Retry-After;
                                                             Redis down and fail-closed: 503 + Retry-After
    read the body, counting bytes (chunked bodies too)    -- over max_body_bytes: 413
    scope["state"]["epd_tenant"] = tenant; run the app (its lease renewed meanwhile)
    finally: limiter.release(lease, scope["state"]["epd_num_tokens"])   (the route sets it)

The release runs however the app ends (done, client gone, exception, cancelled), so no
concurrency slot leaks. Errors are the path's own protocol's body (OpenAI, or Anthropic under
/v1/messages). While the key store holds no key at all the gate is either open (loopback, or
``--allow-unauthenticated``) or closed to everyone; the first key created turns checking on.

With Redis the keys are read through ``key_cache.CachedKeyStore`` (no Redis call per request
while no key exists; keys seen before keep working while Redis is down) and the limits through
``redis_access.DegradingLimiter`` (``--limits-on-redis-failure``: fail-open admits under this
router's own buckets, fail-closed answers 503).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from dataclasses import dataclass, field

from starlette.middleware import Middleware

from services.common import metrics
from services.common.config import ConfigError
from services.common.errors import EPDError
from services.common.metrics import restart_count
from services.router.access.auth import ApiKey, FileKeyStore, KeyStore, configured_keys, hash_key
from services.router.config import RouterConfig
from services.router.errors import error_body_for
from services.router.access.limits import Lease, Limiter, Limits, LocalLimiter, Refusal

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})
"""Everything else is gated, so a route added later cannot be left open by mistake."""
API_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                       "/v1/messages/count_tokens", "/v1/models"})
"""Named in the refusals metric, as is /v1/models/{model} for any model's path; any other path
counts as "other" (scanners must not grow labels)."""
REFUSALS = metrics.counter(
    "epd_router_gate_refusals", "Requests the gate turned away, by endpoint and reason (missing_key, "
    "unknown_key, revoked_key, rpm, tpm, max_concurrency, body_too_large, key_store_unavailable, "
    "limits_unavailable)",
    ["endpoint", "reason"])
_ASK_FOR_KEY = ((b"www-authenticate", b"Bearer"),)
UNAVAILABLE_RETRY_AFTER_S = 1
"""What a 503 for Redis being down tells the client to wait: the first probe comes about then."""
_RETRY_SOON = ((b"retry-after", str(UNAVAILABLE_RETRY_AFTER_S).encode()),)


@dataclass(frozen=True)
class Denial:
    """The gate's answer instead of the app's."""

    status: int
    reason: str
    """The refusals metric's label."""
    message: str
    code: str | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()


@dataclass
class Gate:
    """What the middleware checks against (one per router process)."""

    store: KeyStore
    limiter: Limiter
    default_limits: Limits = Limits()
    """Limits of keys that have none of their own."""
    max_body_bytes: int = 16 * 1024 * 1024
    is_open_without_keys: bool = True
    """While the store holds no key at all: anyone may call (True), or nobody (False)."""
    _has_keys: bool = field(default=False, init=False)
    """Latched: once a key exists, the gate checks keys until the process ends."""

    def middleware(self) -> Middleware:
        return Middleware(GateMiddleware, gate=self)

    async def identify(self, headers: dict[bytes, bytes]) -> ApiKey | Denial | None:
        """The caller's key; None: open access."""
        if not self._has_keys:
            self._has_keys = await self.store.has_keys()
            if not self._has_keys and self.is_open_without_keys:
                return None
        presented = presented_key(headers)
        if presented is None:
            return Denial(401, "missing_key", "an API key is required: send it as Authorization: Bearer KEY "
                          "(OpenAI) or x-api-key: KEY (Anthropic)", "invalid_api_key", _ASK_FOR_KEY)
        key = await self.store.find(hash_key(presented))
        if key is None:
            return Denial(401, "unknown_key", "invalid API key", "invalid_api_key", _ASK_FOR_KEY)
        if key.revoked:
            return Denial(403, "revoked_key", f"API key {key.key_id} has been revoked", "revoked_api_key")
        return key

    async def close(self) -> None:
        close = getattr(self.store, "close", None)
        if close is not None:
            await close()


def presented_key(headers: dict[bytes, bytes]) -> str | None:
    authorization = headers.get(b"authorization", b"").decode("latin-1").strip()
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    api_key = headers.get(b"x-api-key", b"").decode("latin-1").strip()
    return api_key or None


class GateMiddleware:
    def __init__(self, app, gate: Gate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            admitted = await self._admit(dict(scope["headers"]))
        except EPDError as exc:  # the key store (Redis) is down and this key unknown here: closed, not open
            admitted = Denial(exc.http_status, "key_store_unavailable", str(exc), headers=_RETRY_SOON)
        if isinstance(admitted, Denial):
            await _deny(send, scope["path"], admitted)
            return
        key, lease = admitted
        state = scope.setdefault("state", {})
        if key is not None:
            state["epd_tenant"] = key.tenant
        try:
            await self._read_and_run(scope, receive, send, lease)
        finally:
            if lease is not None:
                # Shielded: a second cancel must not cut the release short (Redis is a round trip).
                await asyncio.shield(self._release(lease, state.get("epd_num_tokens", 0)))

    async def _admit(self, headers: dict[bytes, bytes]) -> tuple[ApiKey | None, Lease | None] | Denial:
        """The caller's key (None: open access) and its lease (None: no limits), or why not."""
        gate = self.gate
        key = await gate.identify(headers)
        if isinstance(key, Denial):
            return key
        declared = _content_length(headers)
        if declared is not None and declared > gate.max_body_bytes:
            return _too_large(f"has {declared} bytes (Content-Length)", gate.max_body_bytes)
        if key is None or (limits := key.limits(gate.default_limits)).is_unlimited:
            return key, None
        try:
            acquired = await gate.limiter.acquire(key.sha256, limits)
        except EPDError as exc:  # Redis down and --limits-on-redis-failure fail-closed
            return Denial(503, "limits_unavailable", f"{exc}; retry shortly", headers=_RETRY_SOON)
        if isinstance(acquired, Refusal):
            return Denial(429, acquired.limit, acquired.message(limits), "rate_limit_exceeded",
                          ((b"retry-after", str(acquired.retry_after_s).encode()),))
        return key, acquired

    async def _read_and_run(self, scope, receive, send, lease: Lease | None) -> None:
        body = await _read_body(receive, self.gate.max_body_bytes)
        if body is None:  # the client went away while sending
            return
        if isinstance(body, Denial):
            await _deny(send, scope["path"], body)
            return
        renewing = None
        if lease is not None and lease.limits.max_concurrency and self.gate.limiter.renew_every_s:
            renewing = asyncio.ensure_future(self._renew_forever(lease))
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            if renewing is not None:
                renewing.cancel()

    async def _renew_forever(self, lease: Lease) -> None:
        while True:
            await asyncio.sleep(self.gate.limiter.renew_every_s)
            try:
                await self.gate.limiter.renew(lease)
            except EPDError as exc:  # the lease may lapse: the limit then admits one request too many
                logger.warning("could not renew a concurrency lease of key %s: %s", lease.key_id[:12], exc)

    async def _release(self, lease: Lease, num_tokens: int) -> None:
        try:
            await self.gate.limiter.release(lease, int(num_tokens or 0))
        except EPDError as exc:  # the lease expires by itself; these tokens go uncharged
            logger.warning("could not release a request of key %s: %s", lease.key_id[:12], exc)


def _content_length(headers: dict[bytes, bytes]) -> int | None:
    try:
        return int(headers[b"content-length"])
    except (KeyError, ValueError):
        return None  # none (chunked), or malformed: the bytes are counted as they arrive


def _too_large(size: str, max_bytes: int) -> Denial:
    return Denial(413, "body_too_large", f"the request body {size}; this server accepts at most {max_bytes} "
                  "bytes (--max-body-bytes)", "request_too_large")


async def _read_body(receive, max_bytes: int) -> bytes | Denial | None:
    """The whole body (None: the client disconnected); the app gets it replayed in one message."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            return _too_large(f"has at least {size} bytes", max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """The body first, then the server's own receive (the disconnect the routes wait for)."""
    is_sent = False

    async def replay() -> dict:
        nonlocal is_sent
        if not is_sent:
            is_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def _endpoint_label(path: str) -> str:
    """The refusals metric's ``endpoint`` for ``path`` (a bounded set of values)."""
    if path in API_PATHS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


async def _deny(send, path: str, denial: Denial) -> None:
    REFUSALS.labels(_endpoint_label(path), denial.reason).inc()
    body = json.dumps(error_body_for(path)(denial.status, denial.message, None, denial.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *denial.headers]
    try:
        await send({"type": "http.response.start", "status": denial.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    except OSError:  # the client is gone: nobody to tell
        pass


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def open_without_keys(host: str, has_keys: bool, has_store: bool, allow_unauthenticated: bool) -> bool:
    """Whether the API is open while no key exists; raises ConfigError where it must not start:
    beyond loopback, with no key and nowhere to create one, unless explicitly allowed."""
    is_local = is_loopback(host)
    if not (has_keys or has_store or is_local or allow_unauthenticated):
        raise ConfigError(
            f"the router listens on {host}, beyond this machine, and has no API keys: give keys "
            "(EPD_ROUTER_API_KEYS=KEY or TENANT:KEY, comma-separated), a keys file (--api-keys-file / "
            "EPD_ROUTER_API_KEYS_FILE) or Redis (--redis-url / EPD_ROUTER_REDIS_URL), or serve it open "
            "with --allow-unauthenticated / EPD_ROUTER_ALLOW_UNAUTHENTICATED=1", "allow_unauthenticated")
    return is_local or allow_unauthenticated


async def build_gate(config: RouterConfig) -> Gate:
    """The gate the config asks for; keys from --api-keys are added to the store first."""
    if config.redis_url:
        from services.common.redis_link import RedisHealth, async_client
        from services.router.access.key_cache import CachedKeyStore
        from services.router.access.redis_access import DegradingLimiter, RedisKeyStore, RedisLimiter, redacted
        client, health = async_client(config.redis_url), RedisHealth("router")
        store = CachedKeyStore(RedisKeyStore(client, where=f"Redis {redacted(config.redis_url)}", health=health),
                               ttl_s=config.key_cache_ttl_s)
        limiter = DegradingLimiter(RedisLimiter(client, health=health),
                                   fail_open=config.limits_on_redis_failure == "fail-open")
    else:
        try:
            store, limiter = FileKeyStore(config.api_keys_file or None), LocalLimiter()
        except (ValueError, OSError) as exc:
            raise ConfigError(f"--api-keys-file / EPD_ROUTER_API_KEYS_FILE: {exc}", "api_keys_file") from None
    try:
        try:
            configured = configured_keys(config.api_keys)
        except ValueError as exc:  # not ConfigError's "(got ...)": that would print the keys
            raise ConfigError(f"--api-keys / EPD_ROUTER_API_KEYS: {exc}", "api_keys") from None
        try:
            for key in configured:
                await store.add(key)
            has_keys = await store.has_keys()
        except EPDError as exc:  # Redis unreachable
            if not (config.redis_url and restart_count()):  # a first start: most likely a wrong URL
                raise ConfigError(f"--redis-url / EPD_ROUTER_REDIS_URL: {exc}", "redis_url") from None
            # Restarted by its supervisor during an outage: serve what can be served.
            logger.warning("Redis is unreachable (%s): serving without it until it answers (the configured "
                           "keys work; other keys, and every request if none is configured, get 503)", exc)
            store.start_unreachable(configured)
            has_keys = bool(configured)
        is_open = open_without_keys(config.host, has_keys, store.is_persistent, config.allow_unauthenticated)
    except BaseException:
        await Gate(store, limiter).close()
        raise
    if has_keys:
        logger.info("API keys required (%s)", store.where)
    elif is_open:
        logger.warning("no API keys: the API on %s is open to anyone who can reach it%s. Add keys with "
                       "EPD_ROUTER_API_KEYS=KEY (or TENANT:KEY), or start with --api-keys-file PATH or --redis-url "
                       "URL and run `epd admin keys create TENANT`", config.host,
                       " on this machine" if is_loopback(config.host) else "")
    else:
        logger.warning("no API keys yet in %s: every API request gets 401 until one is created "
                       "(epd admin keys create TENANT)", store.where)
    return Gate(store, limiter, Limits(config.rpm, config.tpm, config.max_concurrency), config.max_body_bytes, is_open)
