"""The block index in Redis: several store nodes (and routers) share one view of what is stored.

Same contract and same decisions as :class:`~kvstore.index.EmbeddedIndex` (the tests run one
suite against both): TTLs renewed on hit, eviction of expired blocks first, then the least
recently used. Time comes from the caller's clock (so tests can move it), and every key also
carries a Redis TTL that follows its block's, so an abandoned index empties itself.

A store node decides with its own embedded index and publishes it here
(``mirrored_index.MirroredIndex``, through :meth:`RedisIndex.publish` and
:meth:`RedisIndex.replace_all`); other nodes read it with :meth:`RedisIndex.peek`, which renews
nothing (only the holder's own hits renew its blocks).

Per index (``prefix``)::

    {prefix}:b:<hash>   string: the block's TTL in seconds        PEXPIRE = the block's TTL
    {prefix}:exp        sorted set: hash -> expires_at             (expired first)
    {prefix}:lru        sorted set: hash -> last use, a tick       (then least recently used)
    {prefix}:tick       counter: one tick per use (never two uses tie, as times can)
    {prefix}:published  "1" once a node published its whole index (gone: Redis lost it)

Lookups and inserts are Lua scripts, so concurrent nodes never see half an update.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping, Sequence

import redis

from kvstore.index import BlockIndex, Clock

PUBLISH_BATCH = 1000
"""Changes per pipeline: a node re-publishing 64K blocks sends 64 round trips, none of them long."""

# ARGV: now, is_prefix ("1": stop at the first miss), hashes...; returns 1/0 per hash looked at.
_LOOKUP = """
local now = tonumber(ARGV[1])
local found = {}
for i = 3, #ARGV do
  local h = ARGV[i]
  local is_live = 0
  local expires = redis.call('ZSCORE', KEYS[1], h)
  if expires and tonumber(expires) > now then
    local ttl = tonumber(redis.call('GET', KEYS[3] .. h) or '0')
    if ttl > 0 then
      redis.call('ZADD', KEYS[1], now + ttl, h)
      redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), h)
      redis.call('PEXPIRE', KEYS[3] .. h, math.ceil(ttl * 1000))
      is_live = 1
    end
  end
  if is_live == 0 and ARGV[2] == '1' then break end
  table.insert(found, is_live)
end
return found
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
        self._published = f"{prefix}:published"
        self._lookup = client.register_script(_LOOKUP)
        self._insert = client.register_script(_INSERT)

    def lookup(self, hashes: Sequence[Hashable]) -> int:
        if not hashes:
            return 0
        return len(self._lookup(keys=self._keys, args=[repr(self.clock()), "1", *map(_member, hashes)]))

    def present(self, hashes: Sequence[Hashable]) -> list[bool]:
        if not hashes:
            return []
        found = self._lookup(keys=self._keys, args=[repr(self.clock()), "0", *map(_member, hashes)])
        return [bool(x) for x in found]

    def clear(self) -> None:
        """Forget every block of this index (a store node whose memory is new starts empty)."""
        prefix = self._keys[2]
        for batch in _batches(self.client.scan_iter(match=prefix + "*", count=1000)):
            self.client.delete(*batch)
        self.client.delete(self._keys[0], self._keys[1], self._keys[3], self._published)

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

    def peek(self, hashes: Sequence[Hashable]) -> list[bool]:
        """Which of ``hashes`` are live here, renewing none (what another node may ask)."""
        if not hashes:
            return []
        now = self.clock()
        return [s is not None and s > now for s in self.client.zmscore(self._keys[0], [_member(h) for h in hashes])]

    def publish(self, changes: Mapping[Hashable, tuple[float, float] | None]) -> None:
        """Mirror a node's changes: block -> (expires_at, ttl_s), or None when it is gone.

        Removals go first: an index mirroring one of the same capacity that way never has to
        evict on its own. One round trip per PUBLISH_BATCH changes."""
        items = sorted(changes.items(), key=lambda item: item[1] is not None)
        for start in range(0, len(items), PUBLISH_BATCH):
            pipe = self.client.pipeline(transaction=False)
            now = repr(self.clock())
            for block_hash, state in items[start:start + PUBLISH_BATCH]:
                member = _member(block_hash)
                if state is None:
                    pipe.zrem(self._keys[0], member).zrem(self._keys[1], member).delete(self._keys[2] + member)
                else:
                    expires_at, ttl_s = state
                    self._insert(keys=self._keys, args=[now, member, repr(float(ttl_s)), self.capacity_blocks,
                                                        repr(float(expires_at))], client=pipe)
            pipe.execute()

    def replace_all(self, entries: Mapping[Hashable, tuple[float, float]]) -> None:
        """Make this index hold exactly ``entries`` (block -> (expires_at, ttl_s)) and mark it published."""
        self.clear()
        self.publish(entries)
        self.client.set(self._published, "1")

    def is_published(self) -> bool:
        """False once Redis lost what :meth:`replace_all` wrote (restarted empty, flushed)."""
        return bool(self.client.exists(self._published))

    def __len__(self) -> int:
        return int(self.client.zcard(self._keys[1]))


def _batches(items, size: int = 500):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _member(block_hash: Hashable) -> str:
    """Block hashes are bytes (hex in Redis); tests may use short strings."""
    return block_hash.hex() if isinstance(block_hash, bytes) else f"s:{block_hash}"


def _from_member(member: bytes | str) -> Hashable:
    text = member.decode() if isinstance(member, bytes) else member
    return text[2:] if text.startswith("s:") else bytes.fromhex(text)


class NodeRegistry:
    """The store nodes sharing one Redis: each announces its gRPC address under a key that
    expires unless renewed, so a node that dies drops out of :meth:`live` within ``ttl_s``.

    ``{prefix}:nodes`` (set of node ids) · ``{prefix}:alive:<id>`` (its address, PX ttl) ·
    ``{prefix}:n:<id>:...`` (that node's block index).
    """

    def __init__(self, client: redis.Redis, prefix: str = "epd:kv", ttl_s: float = 5.0) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s

    def index_of(self, node_id: str, capacity_blocks: int = 1, clock: Clock = time.time) -> RedisIndex:
        """A node's block index (the capacity matters only to the node that inserts)."""
        return RedisIndex(self.client, capacity_blocks, clock, prefix=f"{self.prefix}:n:{node_id}")

    def announce(self, node_id: str, address: str) -> None:
        """Register or renew a node; call it more often than every ``ttl_s``."""
        pipe = self.client.pipeline()
        pipe.sadd(f"{self.prefix}:nodes", node_id)
        pipe.set(f"{self.prefix}:alive:{node_id}", address, px=int(self.ttl_s * 1000))
        pipe.execute()

    def withdraw(self, node_id: str) -> None:
        self.client.delete(f"{self.prefix}:alive:{node_id}")

    def live(self) -> dict[str, str]:
        """node id -> gRPC address of every node whose announcement has not expired."""
        node_ids = sorted(m.decode() for m in self.client.smembers(f"{self.prefix}:nodes"))
        if not node_ids:
            return {}
        addresses = self.client.mget([f"{self.prefix}:alive:{n}" for n in node_ids])
        return {n: a.decode() for n, a in zip(node_ids, addresses) if a is not None}
