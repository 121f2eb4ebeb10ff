"""The block index in Redis: several store nodes (and routers) share one view of what is stored.

Same contract and same decisions as :class:`~kvstore.index.EmbeddedIndex` (the tests run one
suite against both): TTLs renewed on hit, eviction of expired blocks first, then the least
recently used. Time comes from the caller's clock (so tests can move it), and every key also
carries a Redis TTL that follows its block's, so an abandoned index empties itself.

Per index (``prefix``)::

    {prefix}:b:<hash>   string: the block's TTL in seconds        PEXPIRE = the block's TTL
    {prefix}:exp        sorted set: hash -> expires_at             (expired first)
    {prefix}:lru        sorted set: hash -> last use, a tick       (then least recently used)
    {prefix}:tick       counter: one tick per use (never two uses tie, as times can)

Lookups and inserts are Lua scripts, so concurrent nodes never see half an update.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

import redis

from kvstore.index import BlockIndex, Clock

_LOOKUP = """
local now = tonumber(ARGV[1])
local hits = 0
for i, h in ipairs(ARGV) do
  if i > 1 then
    local expires = redis.call('ZSCORE', KEYS[1], h)
    if not expires or tonumber(expires) <= now then break end
    local ttl = tonumber(redis.call('GET', KEYS[3] .. h) or '0')
    if ttl <= 0 then break end
    redis.call('ZADD', KEYS[1], now + ttl, h)
    redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), h)
    redis.call('PEXPIRE', KEYS[3] .. h, math.ceil(ttl * 1000))
    hits = hits + 1
  end
end
return hits
"""

_INSERT = """
local now, h, ttl, capacity = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local expires_at = now + ttl
if ARGV[5] ~= '' then expires_at = tonumber(ARGV[5]) end
local evicted = {}
local old = redis.call('ZSCORE', KEYS[1], h)
if old then
  local old_ttl = tonumber(redis.call('GET', KEYS[3] .. h) or '0')
  if old_ttl > ttl then ttl = old_ttl end
  if ARGV[5] == '' then expires_at = now + ttl end
else
  while redis.call('ZCARD', KEYS[2]) >= capacity do
    local victim = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 1)[1]
    if not victim then victim = redis.call('ZRANGE', KEYS[2], 0, 0)[1] end
    redis.call('ZREM', KEYS[1], victim)
    redis.call('ZREM', KEYS[2], victim)
    redis.call('DEL', KEYS[3] .. victim)
    table.insert(evicted, victim)
  end
end
redis.call('SET', KEYS[3] .. h, tostring(ttl), 'PX', math.max(1, math.ceil((expires_at - now) * 1000)))
redis.call('ZADD', KEYS[1], expires_at, h)
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), h)
return evicted
"""


class RedisIndex(BlockIndex):
    def __init__(self, client: redis.Redis, capacity_blocks: int, clock: Clock = time.time,
                 prefix: str = "epd:kv") -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1 (got {capacity_blocks})")
        self.client = client
        self.capacity_blocks = capacity_blocks
        self.clock = clock
        self._keys = [f"{prefix}:exp", f"{prefix}:lru", f"{prefix}:b:", f"{prefix}:tick"]
        self._lookup = client.register_script(_LOOKUP)
        self._insert = client.register_script(_INSERT)

    def lookup(self, hashes: Sequence[Hashable]) -> int:
        if not hashes:
            return 0
        return int(self._lookup(keys=self._keys, args=[repr(self.clock()), *map(_member, hashes)]))

    def insert(self, block_hash: Hashable, ttl_s: float, expires_at: float | None = None) -> list[Hashable]:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 (got {ttl_s!r})")
        evicted = self._insert(keys=self._keys, args=[
            repr(self.clock()), _member(block_hash), repr(float(ttl_s)), self.capacity_blocks,
            "" if expires_at is None else repr(float(expires_at))])
        return [_from_member(m) for m in evicted]

    def remove(self, block_hash: Hashable) -> bool:
        member = _member(block_hash)
        pipe = self.client.pipeline()
        pipe.zrem(self._keys[0], member).zrem(self._keys[1], member).delete(self._keys[2] + member)
        return bool(pipe.execute()[0])

    def is_live(self, block_hash: Hashable) -> bool:
        expires = self.client.zscore(self._keys[0], _member(block_hash))
        return expires is not None and expires > self.clock()

    def __len__(self) -> int:
        return int(self.client.zcard(self._keys[1]))


def _member(block_hash: Hashable) -> str:
    """Block hashes are bytes (hex in Redis); tests may use short strings."""
    return block_hash.hex() if isinstance(block_hash, bytes) else f"s:{block_hash}"


def _from_member(member: bytes | str) -> Hashable:
    text = member.decode() if isinstance(member, bytes) else member
    return text[2:] if text.startswith("s:") else bytes.fromhex(text)
