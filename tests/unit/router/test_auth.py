"""API key stores (a keys file, Redis: one suite for both), config keys, and the admin API and
``epd admin keys`` that manage them."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import pytest
from starlette.testclient import TestClient

from services.router.admin import cli as admin_cli
from services.router.admin.app import create_admin_app
from services.router.access.auth import (ApiKey, FileKeyStore, KeyNotFound, hash_key, new_key, parse_config_key,
                                  seed)
from services.router.access.limits import Limits
from tests.unit.router.gate_fakes import RedisBacked

TOKEN = "admin-token"


class Stores(RedisBacked):
    """Stores of one kind over one set of keys (one file, one Redis prefix), made in the test's loop."""

    def __init__(self, kind: str, tmp_path, redis_url: str | None) -> None:
        super().__init__(kind, redis_url)
        self.path = tmp_path / "keys.json"

    def make(self):
        if self.kind == "file":
            return FileKeyStore(self.path, reload_every_s=0)
        from services.router.access.redis_access import RedisKeyStore
        return RedisKeyStore(self.redis_client(), self.prefix)


@pytest.fixture(params=["file", "redis"])
def stores(request, tmp_path) -> Stores:
    return Stores(request.param, tmp_path, request.getfixturevalue("redis_url") if request.param == "redis" else None)


def record(key: str, tenant: str = "acme", **kwargs) -> ApiKey:
    return ApiKey(hash_key(key), tenant, created_at=1.0, **kwargs)


def test_config_keys_name_their_tenant():
    assert parse_config_key("sk-1") == ("default", "sk-1")
    assert parse_config_key("acme:sk-1") == ("acme", "sk-1")
    with pytest.raises(ValueError, match="empty"):
        parse_config_key("acme:")
    with pytest.raises(ValueError, match="tenant 'a b'"):
        parse_config_key("a b:sk-1")


def test_a_key_without_limits_takes_the_defaults():
    defaults = Limits(rpm=10, tpm=1000, max_concurrency=2)
    assert record("k").limits(defaults) == defaults
    assert record("k", rpm=0, max_concurrency=5).limits(defaults) == Limits(0, 1000, 5)


def test_store_round_trip_and_sharing(stores):
    async def test():
        one, two = stores.make(), stores.make()
        assert not await one.has_keys() and await one.find(hash_key("k1")) is None
        assert await one.add(record("k1", rpm=5))
        assert not await two.add(record("k1", tenant="other"))  # already there: left as it was
        assert await two.has_keys()
        assert await two.find(hash_key("k1")) == record("k1", rpm=5)
        await two.add(record("k2", tenant="beta"))
        assert sorted(k.tenant for k in await one.keys()) == ["acme", "beta"]
        revoked = await one.revoke(hash_key("k2")[:8])
        assert revoked == record("k2", tenant="beta", revoked=True)
        assert (await two.find(hash_key("k2"))).revoked  # the other instance sees it at once
        assert not (await two.find(hash_key("k1"))).revoked
    stores.run(test)


def test_revoke_needs_exactly_one_match(stores):
    async def test():
        store = stores.make()
        await store.add(ApiKey("abcdef01" + "0" * 56, "a"))
        await store.add(ApiKey("abcdef02" + "0" * 56, "b"))
        with pytest.raises(KeyNotFound) as ambiguous:
            await store.revoke("abcdef0")
        assert ambiguous.value.num_matches == 2
        with pytest.raises(KeyNotFound) as missing:
            await store.revoke("123456")
        assert missing.value.num_matches == 0
        with pytest.raises(KeyNotFound) as short:
            await store.revoke("abc")
        assert short.value.num_matches is None
        assert not any(key.revoked for key in await store.keys())
    stores.run(test)


def test_seeded_keys_are_added_once_and_a_revoke_sticks(stores):
    async def test():
        store = stores.make()
        assert await seed(store, ("sk-1", "acme:sk-2")) == 2
        assert (await store.find(hash_key("sk-1"))).tenant == "default"
        await store.revoke(hash_key("sk-2")[:10])
        assert await seed(stores.make(), ("sk-1", "acme:sk-2")) == 0  # a restart with the same config
        assert (await store.find(hash_key("sk-2"))).revoked
    stores.run(test)


def test_the_keys_file_holds_hashes_only(tmp_path):
    path = tmp_path / "new" / "keys.json"
    store = FileKeyStore(path)
    key = new_key()
    assert key.startswith("epd-") and len(key) > 40
    asyncio.run(store.add(record(key, tpm=100)))
    text = path.read_text()
    assert key not in text and key[4:] not in text
    assert json.loads(text) == {"version": 1, "keys": [{
        "sha256": hash_key(key), "tenant": "acme", "rpm": None, "tpm": 100, "max_concurrency": None,
        "revoked": False, "created_at": 1.0}]}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["keys.json"]  # no temporary file left


def test_an_empty_or_missing_keys_file_means_no_keys_yet(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("")
    assert not asyncio.run(FileKeyStore(empty).has_keys())
    assert not asyncio.run(FileKeyStore(tmp_path / "missing.json").has_keys())
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="not an epd keys file"):
        FileKeyStore(broken)


def test_a_change_on_disk_is_seen_after_the_reload_period(tmp_path):
    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    clock = Clock()
    path = tmp_path / "keys.json"
    reader = FileKeyStore(path, reload_every_s=1.0, clock=clock)
    asyncio.run(FileKeyStore(path).add(record("k1")))
    assert asyncio.run(reader.find(hash_key("k1"))) is None  # within the period: not looked at yet
    clock.now = 1.0
    assert asyncio.run(reader.find(hash_key("k1"))) == record("k1")
    path.write_text('{"keys": [')  # a hand edit half done: the keys read before still hold
    clock.now = 2.0
    assert asyncio.run(reader.find(hash_key("k1"))) == record("k1")


def test_a_memory_store_is_not_persistent():
    store = FileKeyStore(None)
    assert not store.is_persistent and store.where == "memory"
    asyncio.run(seed(store, ("sk-1",)))
    assert asyncio.run(store.has_keys())


@pytest.fixture
def admin(tmp_path):
    store = FileKeyStore(tmp_path / "keys.json")
    with TestClient(create_admin_app({}, TOKEN, keys=store)) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        yield client, store


def test_admin_creates_lists_and_revokes_keys(admin):
    client, store = admin
    created = client.post("/admin/keys", json={"tenant": "acme", "rpm": 5, "max_concurrency": 2})
    assert created.status_code == 200, created.text
    body = created.json()
    key = body.pop("key")
    assert body == {"id": hash_key(key)[:12], "tenant": "acme", "rpm": 5, "tpm": None, "max_concurrency": 2,
                    "revoked": False, "created_at": body["created_at"]}
    listed = client.get("/admin/keys")
    assert listed.json() == [body] and key not in listed.text
    assert asyncio.run(store.find(hash_key(key))).rpm == 5
    revoked = client.post(f"/admin/keys/{body['id']}/revoke")
    assert revoked.status_code == 200 and revoked.json() == {**body, "revoked": True}
    assert asyncio.run(store.find(hash_key(key))).revoked


def test_admin_key_errors(admin, tmp_path):
    client, store = admin
    asyncio.run(store.add(ApiKey("abcdef01" + "0" * 56, "a")))
    asyncio.run(store.add(ApiKey("abcdef02" + "0" * 56, "b")))
    assert client.post("/admin/keys/abcdef0/revoke").status_code == 409
    assert client.post("/admin/keys/999999/revoke").status_code == 404
    short = client.post("/admin/keys/ab/revoke")
    assert short.status_code == 400 and "at least 6 hex digits" in short.json()["error"]["message"]
    assert client.post("/admin/keys", json={"tenant": "a b"}).status_code == 400
    assert client.post("/admin/keys", json={"tenant": "a", "rpm": -1}).status_code == 422
    assert client.get("/admin/keys", headers={"Authorization": "Bearer wrong"}).status_code == 401
    with TestClient(create_admin_app({}, TOKEN, keys=FileKeyStore(None))) as memory_only:
        refused = memory_only.post("/admin/keys", json={"tenant": "a"}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert refused.status_code == 409 and "--api-keys-file" in refused.json()["error"]["message"]


def test_without_a_store_the_admin_api_has_no_key_routes():
    with TestClient(create_admin_app({}, TOKEN)) as client:
        assert client.get("/admin/keys", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404


@pytest.mark.parametrize("argv, expected", [
    (["keys", "create", "acme"], ("POST", "/admin/keys", {"tenant": "acme"})),
    (["keys", "create", "acme", "--rpm", "5", "--max-concurrency", "0"],
     ("POST", "/admin/keys", {"tenant": "acme", "rpm": 5, "max_concurrency": 0})),
    (["keys", "list"], ("GET", "/admin/keys", None)),
    (["keys", "revoke", "ABCDEF12"], ("POST", "/admin/keys/abcdef12/revoke", None)),
    (["keys", "revoke", "epd-secret"], ("POST", f"/admin/keys/{hash_key('epd-secret')}/revoke", None)),
])
def test_epd_admin_keys_commands(argv, expected):
    assert admin_cli.request(admin_cli.parser().parse_args(argv)) == expected


def test_epd_admin_keys_against_a_running_admin_api(tmp_path, capsys):
    from tests.unit.router.fakes import ServerThread

    store = FileKeyStore(tmp_path / "keys.json")
    with ServerThread(create_admin_app({}, TOKEN, keys=store)) as server:
        base = ["--url", server.url, "--token", TOKEN, "keys"]
        assert admin_cli.main([*base, "create", "acme", "--tpm", "1000"]) == 0
        out, err = capsys.readouterr()
        key = json.loads(out)["key"]
        assert "shown this once" in err
        assert admin_cli.main([*base, "revoke", key]) == 0  # by the key itself: hashed before it is sent
        capsys.readouterr()
        assert admin_cli.main([*base, "list"]) == 0
        listed = json.loads(capsys.readouterr().out)
    assert listed == [{"id": hash_key(key)[:12], "tenant": "acme", "rpm": None, "tpm": 1000,
                       "max_concurrency": None, "revoked": True, "created_at": listed[0]["created_at"]}]
