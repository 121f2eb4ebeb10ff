"""The router's copy of a remote key store (Redis), so requests neither wait on it nor fail with it.

What a request asks of Redis::

    no key exists (yet)   nothing: whether any exists is learnt at start, then re-asked in the
                          background at most once per ttl_s (a failure keeps the last answer);
                          once one exists the gate checks keys for good (its latch)
    a key seen < ttl_s    nothing: the cached record answers
    a key seen >= ttl_s   its record, afresh; Redis down: the cached record answers
    a key never seen      its record; Redis down: 503 "cannot verify" (UnavailableError)

A router restarted while Redis is down (:meth:`CachedKeyStore.start_unreachable`) serves the
keys it is configured with from the cache and writes them to Redis once it answers.

So a revoke reaches every router within ttl_s while Redis is up, and keys that were in use keep
working while it is down. Only records that exist are cached (the keys an operator made: a
bounded set); an unknown key is asked about every time, as before. Keys added or revoked through
this router (the admin API) enter the cache at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from services.common.errors import EPDError, UnavailableError
from services.router.access.auth import ApiKey, KeyStore

DEFAULT_TTL_S = 5.0


class CachedKeyStore:
    """A KeyStore in front of another (Redis): the same methods, the answers described above."""

    def __init__(self, store: KeyStore, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.clock = clock
        self.is_persistent = store.is_persistent
        self.where = store.where
        self._keys: dict[str, tuple[ApiKey, float]] = {}  # sha256 -> (record, when it was read)
        self._has_keys: bool | None = None  # None: not asked yet
        self._has_keys_at = float("-inf")
        self._refreshing: asyncio.Future | None = None
        self._seeding: asyncio.Future | None = None

    async def find(self, sha256: str) -> ApiKey | None:
        cached = self._keys.get(sha256)
        now = self.clock()
        if cached is not None and now - cached[1] < self.ttl_s:
            return cached[0]
        try:
            key = await self.store.find(sha256)
        except EPDError as exc:
            if cached is not None:
                return cached[0]  # stale, but the best answer there is while Redis is down
            raise UnavailableError(f"cannot verify this API key: it has not been used on this router before "
                                   f"and {exc}; retry shortly") from exc
        self._remember(key, now)
        if key is None:
            self._keys.pop(sha256, None)
        return key

    async def has_keys(self) -> bool:
        """No I/O on a request's path but the very first (the router's start, which may fail)."""
        if self._has_keys is None:
            self._has_keys = await self.store.has_keys()
            self._has_keys_at = self.clock()
        elif not self._has_keys and self._refreshing is None and self.clock() - self._has_keys_at >= self.ttl_s:
            self._has_keys_at = self.clock()  # one try per period, failed or not
            self._refreshing = asyncio.ensure_future(self._refresh_has_keys())
        return self._has_keys

    def start_unreachable(self, configured: list[ApiKey], retry_s: float = 1.0) -> None:
        """The store could not be reached when this router started (a restart during an
        outage): the configured keys work from the cache and are written to the store once it
        answers. Keys are required meanwhile if any is configured; with none, whether the store
        holds any is unknown, so each request asks it (503 while it cannot answer)."""
        for key in configured:
            self._remember(key, self.clock())
        if configured:
            self._seeding = asyncio.ensure_future(self._seed_when_back(configured, retry_s))

    async def _seed_when_back(self, configured: list[ApiKey], retry_s: float) -> None:
        while True:
            try:
                for key in configured:
                    await self.store.add(key)
                return
            except EPDError:
                await asyncio.sleep(retry_s)

    async def add(self, key: ApiKey) -> bool:
        is_added = await self.store.add(key)
        if is_added:
            self._remember(key, self.clock())
        return is_added

    async def keys(self) -> list[ApiKey]:
        return await self.store.keys()

    async def revoke(self, id_prefix: str) -> ApiKey:
        key = await self.store.revoke(id_prefix)
        self._remember(key, self.clock())
        return key

    async def close(self) -> None:
        for task in (self._refreshing, self._seeding):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        close = getattr(self.store, "close", None)
        if close is not None:
            await close()

    def _remember(self, key: ApiKey | None, now: float) -> None:
        if key is not None:
            self._keys[key.sha256] = (key, now)
            self._has_keys = True

    async def _refresh_has_keys(self) -> None:
        try:
            self._has_keys = self._has_keys or await self.store.has_keys()
        except EPDError:
            pass  # the last answer stands; the store's RedisHealth has logged the outage
        finally:
            self._refreshing = None
