"""The admin API's API-key routes (mounted by admin.py, behind its bearer token)::

    POST /admin/keys                  {"tenant", "rpm"?, "tpm"?, "max_concurrency"?}: a new key; the
                                      reply holds its text, shown this once and never again
    GET  /admin/keys                  every key: id (hash prefix), tenant, limits, revoked
    POST /admin/keys/{id}/revoke      at least 6 hex digits of the id; takes effect on the next request

Limits left out (null) take the router's defaults; 0 is unlimited. Keys go to the router's store
(keys file or Redis); with neither, a created key would vanish at restart, so creating is refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from services.common.errors import EPDError
from services.router.access.auth import ApiKey, KeyNotFound, KeyStore, check_tenant, hash_key, new_key


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str
    """Whose key it is: its requests share cached prefixes only with the same tenant's."""
    rpm: int | None = Field(default=None, ge=0)
    tpm: int | None = Field(default=None, ge=0)
    max_concurrency: int | None = Field(default=None, ge=0)


def add_key_routes(app: FastAPI, store: KeyStore, authorized: Callable, clock=time.time) -> None:
    async def stored(work):
        try:
            return await work
        except EPDError as exc:  # the store (Redis) is unreachable
            raise HTTPException(exc.http_status, str(exc)) from None

    @app.post("/admin/keys", dependencies=[Depends(authorized)])
    async def create_key(request: KeyCreate) -> dict[str, Any]:
        if not store.is_persistent:
            raise HTTPException(409, "this router keeps its keys in memory only, so a key created here would "
                                     "vanish at restart: start it with --api-keys-file PATH or --redis-url URL")
        try:
            check_tenant(request.tenant)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        text = new_key()
        key = ApiKey(hash_key(text), request.tenant, request.rpm, request.tpm, request.max_concurrency,
                     created_at=clock())
        if not await stored(store.add(key)):
            raise RuntimeError("a fresh random key collided with a stored one")
        return {"key": text, **key.view()}

    @app.get("/admin/keys", dependencies=[Depends(authorized)])
    async def list_keys() -> list[dict[str, Any]]:
        return [key.view() for key in await stored(store.keys())]

    @app.post("/admin/keys/{key_id}/revoke", dependencies=[Depends(authorized)])
    async def revoke_key(key_id: str) -> dict[str, Any]:
        try:
            return (await stored(store.revoke(key_id.lower()))).view()
        except KeyNotFound as exc:
            status = 400 if exc.num_matches is None else 404 if exc.num_matches == 0 else 409
            raise HTTPException(status, str(exc)) from None
