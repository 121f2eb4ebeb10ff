"""API keys: who may use the router, as which tenant, under which limits.

A key is stored only as the sha256 hex digest of its text; the text itself is shown once, when
the key is created (``epd-`` + 43 random URL-safe characters). Each record::

    {"sha256": "<64 hex>", "tenant": "acme", "rpm": 60, "tpm": null, "max_concurrency": null,
     "revoked": false, "created_at": 1718000000.0}

``null`` limits take the router's defaults (``--rpm`` / ``--tpm`` / ``--max-concurrency``).
Records are never deleted, only revoked, so a store that ever held a key keeps auth on.

Stores: :class:`FileKeyStore` (a JSON file, ``{"version": 1, "keys": [record, ...]}``, written
atomically, re-read when it changes on disk; or memory only) and ``redis_access.RedisKeyStore``
(several routers sharing keys). Keys given in the configuration (``--api-keys``) are added to the
store at start (:func:`seed`) unless their hash is already there, so a revoke of one sticks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from services.router.access.limits import Limits

logger = logging.getLogger(__name__)

ID_LENGTH = 12
"""Hex digits of the hash shown as a key's id."""
MIN_PREFIX_LENGTH = 6
"""A revoke names at least this many hex digits, so a typo cannot hit an arbitrary key."""
TENANT_PATTERN = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
DEFAULT_TENANT = "default"
RELOAD_EVERY_S = 1.0
"""How often a keys file is checked for changes made by someone else."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "epd-" + secrets.token_urlsafe(32)


def check_tenant(tenant: str) -> None:
    if not TENANT_PATTERN.fullmatch(tenant):
        raise ValueError(f"tenant {tenant!r}: use 1 to 64 letters, digits or _ . @ -")


def parse_config_key(entry: str) -> tuple[str, str]:
    """``KEY`` (tenant "default") or ``TENANT:KEY`` -> (tenant, key)."""
    tenant, sep, key = entry.partition(":")
    if not sep:
        tenant, key = DEFAULT_TENANT, entry
    if not key:
        raise ValueError("an API key is empty (entries are KEY or TENANT:KEY)")
    check_tenant(tenant)
    return tenant, key


@dataclass(frozen=True)
class ApiKey:
    """One key's record; limits left as None take the router's defaults."""

    sha256: str
    tenant: str
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    revoked: bool = False
    created_at: float = 0.0

    @property
    def key_id(self) -> str:
        return self.sha256[:ID_LENGTH]

    def limits(self, defaults: Limits) -> Limits:
        return Limits(rpm=defaults.rpm if self.rpm is None else self.rpm,
                      tpm=defaults.tpm if self.tpm is None else self.tpm,
                      max_concurrency=defaults.max_concurrency if self.max_concurrency is None
                      else self.max_concurrency)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> ApiKey:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in fields})

    def view(self) -> dict:
        """What the admin API shows: everything but the hash beyond its id."""
        return {"id": self.key_id, "tenant": self.tenant, "rpm": self.rpm, "tpm": self.tpm,
                "max_concurrency": self.max_concurrency, "revoked": self.revoked, "created_at": self.created_at}


class KeyNotFound(LookupError):
    """No key, or more than one, has the id prefix given; ``num_matches`` None: not an id at all."""

    def __init__(self, message: str, num_matches: int | None = None) -> None:
        super().__init__(message)
        self.num_matches = num_matches


class KeyStore(Protocol):
    is_persistent: bool
    """Whether a key added here outlives the process."""
    where: str
    """Where the keys live, for logs: "keys file PATH", "Redis URL", "memory"."""

    async def find(self, sha256: str) -> ApiKey | None: ...
    async def has_keys(self) -> bool: ...
    async def add(self, key: ApiKey) -> bool:
        """False if a key with this hash is already there (it is left as it was)."""
    async def keys(self) -> list[ApiKey]: ...
    async def revoke(self, id_prefix: str) -> ApiKey:
        """The revoked key; raises KeyNotFound."""


async def seed(store: KeyStore, entries: tuple[str, ...], clock=time.time) -> int:
    """Add the configured plaintext keys that the store lacks; how many were added."""
    added = 0
    for key in configured_keys(entries, clock):
        added += await store.add(key)
    return added


def configured_keys(entries: tuple[str, ...], clock=time.time) -> list[ApiKey]:
    """The records of configured plaintext keys (KEY or TENANT:KEY); ValueError for a bad one."""
    return [ApiKey(hash_key(key), tenant, created_at=clock()) for tenant, key in map(parse_config_key, entries)]


def only_match(keys: list[ApiKey], id_prefix: str) -> ApiKey:
    """The one key whose hash starts with ``id_prefix``."""
    if len(id_prefix) < MIN_PREFIX_LENGTH or not re.fullmatch(r"[0-9a-f]+", id_prefix):
        raise KeyNotFound(f"{id_prefix!r} is not a key id: give at least {MIN_PREFIX_LENGTH} hex digits "
                          "of it (epd admin keys list)")
    matches = [key for key in keys if key.sha256.startswith(id_prefix)]
    if len(matches) != 1:
        raise KeyNotFound(f"{len(matches)} keys have an id starting with {id_prefix!r}"
                          + ("; give more digits" if matches else ""), len(matches))
    return matches[0]


class FileKeyStore:
    """Keys in a JSON file (``path``), or in memory only (``path`` None).

    Several processes may read one file; a change written by another is picked up within
    RELOAD_EVERY_S. Writers do not lock: routers that all add keys should share Redis instead.
    """

    def __init__(self, path: str | Path | None, reload_every_s: float = RELOAD_EVERY_S,
                 clock=time.monotonic) -> None:
        self.path = None if path is None else Path(path)
        self.is_persistent = self.path is not None
        self.where = "memory" if self.path is None else f"keys file {self.path}"
        self.reload_every_s = reload_every_s
        self.clock = clock
        self._keys: dict[str, ApiKey] = {}
        self._signature: tuple[int, int, int] | None = None
        self._checked_at = -float("inf")
        self._reload()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino  # a replace changes the inode even within one mtime tick

    def _reload(self) -> None:
        if self.path is None:
            return
        signature = self._stat()
        self._checked_at = self.clock()
        if signature == self._signature:
            return
        if signature is None:
            self._keys = {}
        else:
            try:
                text = self.path.read_text()
                document = json.loads(text) if text.strip() else {}  # an empty file: no keys yet
                self._keys = {r["sha256"]: ApiKey.from_json(r) for r in document.get("keys", [])}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{self.path} is not an epd keys file: {exc}") from None
        self._signature = signature

    def _fresh(self) -> dict[str, ApiKey]:
        if self.path is not None and self.clock() - self._checked_at >= self.reload_every_s:
            try:
                self._reload()
            except ValueError as exc:  # a half-made hand edit: keep serving the keys we had
                self._signature = self._stat()
                logger.error("%s; keeping the %d keys read before", exc, len(self._keys))
        return self._keys

    def _write(self) -> None:
        if self.path is None:
            return
        document = {"version": 1, "keys": [key.to_json() for key in self._keys.values()]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as f:  # mkstemp makes it 0600: key hashes are nobody else's business
                json.dump(document, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise
        self._signature = self._stat()

    async def find(self, sha256: str) -> ApiKey | None:
        return self._fresh().get(sha256)

    async def has_keys(self) -> bool:
        return bool(self._fresh())

    async def add(self, key: ApiKey) -> bool:
        self._reload()  # never write back over a change made by someone else
        if key.sha256 in self._keys:
            return False
        self._keys[key.sha256] = key
        self._write()
        return True

    async def keys(self) -> list[ApiKey]:
        return list(self._fresh().values())

    async def revoke(self, id_prefix: str) -> ApiKey:
        self._reload()
        key = dataclasses.replace(only_match(list(self._keys.values()), id_prefix), revoked=True)
        self._keys[key.sha256] = key
        self._write()
        return key
