"""API keys and per-key limits in Redis: every router sharing it sees one set of keys and one limit.

Layout (``prefix`` defaults to ``epd:router``; the ``{sha256}`` hash tag keeps one key's limit
state in one Redis Cluster slot)::

    {prefix}:keys                         hash: sha256 -> the key's JSON record (auth.py)
    {prefix}:limit:{<sha256>}:rpm         hash: level, at      PEXPIRE: until full again
    {prefix}:limit:{<sha256>}:tpm         hash: level, at      PEXPIRE: until full again
    {prefix}:limit:{<sha256>}:leases      sorted set: lease id -> expires_at (requests in flight)

Admission, release and renewal are Lua scripts (EVALSHA), so the check and the update of all
three happen at once however many routers ask: a key allowed N requests a minute gets N, not
N per router. The scripts follow limits.py's rules exactly (the same float operations in the
same order, ROUNDING_S included), on Redis's own clock (``TIME``, one clock for every router;
tests pass their own). A request in flight holds a lease that expires
LEASE_TTL_S after its last renewal; the router renews it every RENEW_EVERY_S while the request
runs, so a router that dies frees its slots within LEASE_TTL_S instead of leaking them.

A call to a Redis that is down raises UnavailableError (at once while the shared
:class:`~services.common.redis_link.RedisHealth` says Redis is down). What a request then gets
is decided in front of these classes: ``key_cache.CachedKeyStore`` answers from the keys it
has seen (a key never seen: 503), :class:`DegradingLimiter` admits (fail-open: this router's
own buckets, best effort) or lets the gate answer 503 (fail-closed); a failed release or
renewal is only counted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import redis
import redis.asyncio

from services.common import metrics
from services.common.errors import EPDError, UnavailableError
from services.common.redis_link import RedisHealth
from services.router.access.auth import ApiKey, KeyNotFound, only_match
from services.router.access.limits import Clock, Lease, Limiter, Limits, LocalLimiter, Refusal

logger = logging.getLogger(__name__)

LEASE_TTL_S = 60.0
RENEW_EVERY_S = 20.0
_LIMITS = "the per-key limits store (Redis)"

_CLOCK_AND_BUCKETS = """
local function clock(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function level(key, capacity, now)
  local v = redis.call('HMGET', key, 'level', 'at')
  if not v[1] then return capacity end
  return math.min(capacity, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * capacity / 60)
end
local function store(key, capacity, new_level, now)
  redis.call('HSET', key, 'level', string.format('%.17g', new_level), 'at', string.format('%.17g', now))
  redis.call('PEXPIRE', key, math.ceil((capacity - new_level) * 60 / capacity * 1000) + 1000)
end
"""

# KEYS: rpm bucket, tpm bucket, leases. ARGV: now ('': Redis's clock), rpm, tpm, max_concurrency,
# lease id, lease ttl (s). Returns {'', 0} (admitted) or {limit, retry_after_s}.
_ACQUIRE = _CLOCK_AND_BUCKETS + """
local now = clock(ARGV[1])
local rpm, tpm, max_conc, ttl = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[6])
local worst, wait = '', 0
local rpm_level = 0
if rpm > 0 then
  rpm_level = level(KEYS[1], rpm, now)
  if rpm_level < 1 then worst, wait = 'rpm', math.max(1, math.ceil((1 - rpm_level) * 60 / rpm - 1e-9)) end
end
if tpm > 0 then
  local tpm_level = level(KEYS[2], tpm, now)
  if tpm_level <= 0 then
    local w = math.max(1, math.floor(-tpm_level * 60 / tpm + 1e-9) + 1)
    if w > wait then worst, wait = 'tpm', w end
  end
end
if max_conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= max_conc and wait < 1 then worst, wait = 'max_concurrency', 1 end
end
if worst ~= '' then return {worst, wait} end
if rpm > 0 then store(KEYS[1], rpm, rpm_level - 1, now) end
if max_conc > 0 then
  redis.call('ZADD', KEYS[3], now + ttl, ARGV[5])
  redis.call('PEXPIRE', KEYS[3], math.ceil(ttl * 1000) + 1000)
end
return {'', 0}
"""

# KEYS: tpm bucket, leases. ARGV: now, tpm, lease id, tokens used.
_RELEASE = _CLOCK_AND_BUCKETS + """
local now = clock(ARGV[1])
local tpm, used = tonumber(ARGV[2]), tonumber(ARGV[4])
redis.call('ZREM', KEYS[2], ARGV[3])
if tpm > 0 and used > 0 then store(KEYS[1], tpm, level(KEYS[1], tpm, now) - used, now) end
return 1
"""

# KEYS: leases. ARGV: now, lease id, lease ttl (s). A lease already expired stays gone.
_RENEW = _CLOCK_AND_BUCKETS + """
local now = clock(ARGV[1])
local expires = redis.call('ZSCORE', KEYS[1], ARGV[2])
if expires and tonumber(expires) > now then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
  redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3]) * 1000) + 1000)
end
return 1
"""

# KEYS: keys hash. ARGV: sha256. The updated record, or nil.
_REVOKE = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return false end
local record = cjson.decode(v)
record['revoked'] = true
local out = cjson.encode(record)
redis.call('HSET', KEYS[1], ARGV[1], out)
return out
"""


LIMITS_DEGRADED = metrics.counter(
    "epd_router_limits_degraded", "Limiter calls that Redis could not answer, by what became of them: "
    "local (fail-open: this router's own buckets decided), refused (fail-closed: 503), "
    "release / renew (a request's end or lease renewal not recorded in Redis)", ["outcome"])


@contextlib.contextmanager
def _unavailable_on_error(health: RedisHealth, what: str = "the API key store (Redis)") -> Iterator[None]:
    try:
        with health.guard():
            yield
    except redis.RedisError as exc:
        raise UnavailableError(f"{what} is unavailable: {exc}") from exc


def redacted(url: str) -> str:
    """A Redis URL fit for logs: no password."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")).geturl()


class RedisKeyStore:
    is_persistent = True

    def __init__(self, client: redis.asyncio.Redis, prefix: str = "epd:router", where: str = "Redis",
                 health: RedisHealth | None = None) -> None:
        self.client = client
        self.where = where
        self.health = health or RedisHealth("router")
        self._hash = f"{prefix}:keys"
        self._revoke = client.register_script(_REVOKE)

    async def find(self, sha256: str) -> ApiKey | None:
        with _unavailable_on_error(self.health):
            raw = await self.client.hget(self._hash, sha256)
        return None if raw is None else ApiKey.from_json(json.loads(raw))

    async def has_keys(self) -> bool:
        with _unavailable_on_error(self.health):
            return bool(await self.client.exists(self._hash))

    async def add(self, key: ApiKey) -> bool:
        with _unavailable_on_error(self.health):
            return bool(await self.client.hsetnx(self._hash, key.sha256, json.dumps(key.to_json())))

    async def keys(self) -> list[ApiKey]:
        with _unavailable_on_error(self.health):
            records = await self.client.hgetall(self._hash)
        return sorted((ApiKey.from_json(json.loads(raw)) for raw in records.values()), key=lambda k: k.created_at)

    async def close(self) -> None:
        await self.client.aclose()

    async def revoke(self, id_prefix: str) -> ApiKey:
        key = only_match(await self.keys(), id_prefix)
        with _unavailable_on_error(self.health):
            raw = await self._revoke(keys=[self._hash], args=[key.sha256])
        if raw is None:
            raise KeyNotFound(f"key {key.key_id} disappeared while being revoked", 0)
        return ApiKey.from_json(json.loads(raw))


class RedisLimiter:
    """limits.py's buckets and concurrency, shared by every router on this Redis."""

    renew_every_s = RENEW_EVERY_S

    def __init__(self, client: redis.asyncio.Redis, prefix: str = "epd:router", clock: Clock | None = None,
                 lease_ttl_s: float = LEASE_TTL_S, health: RedisHealth | None = None) -> None:
        self.client = client
        self.health = health or RedisHealth("router")
        self.prefix = prefix
        self.clock = clock
        self.lease_ttl_s = lease_ttl_s
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)

    def _now(self) -> str:
        return "" if self.clock is None else repr(float(self.clock()))

    def _key(self, key_id: str, what: str) -> str:
        return f"{self.prefix}:limit:{{{key_id}}}:{what}"

    async def acquire(self, key_id: str, limits: Limits) -> Lease | Refusal:
        lease = Lease(key_id, limits, uuid.uuid4().hex)
        with _unavailable_on_error(self.health, _LIMITS):
            limit, wait_s = await self._acquire(
                keys=[self._key(key_id, "rpm"), self._key(key_id, "tpm"), self._key(key_id, "leases")],
                args=[self._now(), limits.rpm, limits.tpm, limits.max_concurrency, lease.lease_id, self.lease_ttl_s])
        return lease if not limit else Refusal(limit.decode(), int(wait_s))

    async def release(self, lease: Lease, num_tokens: int) -> None:
        with _unavailable_on_error(self.health, _LIMITS):
            await self._release(keys=[self._key(lease.key_id, "tpm"), self._key(lease.key_id, "leases")],
                                args=[self._now(), lease.limits.tpm, lease.lease_id, max(0, num_tokens)])

    async def renew(self, lease: Lease) -> None:
        if lease.limits.max_concurrency:
            with _unavailable_on_error(self.health, _LIMITS):
                await self._renew(keys=[self._key(lease.key_id, "leases")],
                                  args=[self._now(), lease.lease_id, self.lease_ttl_s])

    async def num_in_flight(self, key_id: str) -> int:
        """Leases held now, expired ones included until the next admission sweeps them."""
        with _unavailable_on_error(self.health, _LIMITS):
            return int(await self.client.zcard(self._key(key_id, "leases")))


class DegradingLimiter:
    """The shared limiter (Redis), and what admission does while Redis cannot answer.

    fail-open (default): this router's own buckets decide (a LocalLimiter: each router enforces
    every limit by itself, so N routers admit up to N times a limit; best effort for the outage).
    fail-closed: the error reaches the gate, which answers 503 with Retry-After. Either way a
    release or renewal that fails is only counted, never raised into the request: the lease
    lapses in Redis by itself (LEASE_TTL_S) and that request's tokens go uncharged.
    """

    def __init__(self, shared: Limiter, fail_open: bool = True, local: Limiter | None = None) -> None:
        self.shared = shared
        self.fail_open = fail_open
        self.local = local or LocalLimiter()
        self.renew_every_s = shared.renew_every_s
        self._local_lease_ids: set[str] = set()
        self._is_degraded = False

    async def acquire(self, key_id: str, limits: Limits) -> Lease | Refusal:
        try:
            acquired = await self.shared.acquire(key_id, limits)
        except EPDError as exc:
            self._note_outage(exc)
            if not self.fail_open:
                LIMITS_DEGRADED.labels("refused").inc()
                raise
            LIMITS_DEGRADED.labels("local").inc()
            acquired = await self.local.acquire(key_id, limits)
            if isinstance(acquired, Lease):
                self._local_lease_ids.add(acquired.lease_id)
            return acquired
        self._is_degraded = False
        return acquired

    async def release(self, lease: Lease, num_tokens: int) -> None:
        if lease.lease_id in self._local_lease_ids:
            self._local_lease_ids.discard(lease.lease_id)
            await self.local.release(lease, num_tokens)
            return
        try:
            await self.shared.release(lease, num_tokens)
        except EPDError:
            LIMITS_DEGRADED.labels("release").inc()

    async def renew(self, lease: Lease) -> None:
        if lease.lease_id in self._local_lease_ids:
            return
        try:
            await self.shared.renew(lease)
        except EPDError:
            LIMITS_DEGRADED.labels("renew").inc()

    async def num_in_flight(self, key_id: str) -> int:
        return await self.shared.num_in_flight(key_id)

    def _note_outage(self, error: EPDError) -> None:
        """Once per outage: the per-call failures are counted, not logged."""
        if self._is_degraded:
            return
        self._is_degraded = True
        logger.warning("per-key limits cannot be checked in Redis (%s): %s until it answers again "
                       "(--limits-on-redis-failure)", error,
                       "each router enforces them on its own (fail-open)" if self.fail_open
                       else "requests of keys with limits get 503 (fail-closed)")
