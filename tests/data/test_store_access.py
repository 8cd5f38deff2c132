"""Who may read and upload: keys of the router's key database, and the store over TLS."""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from stores import StartStore

from certs import Certs, make_certs
from shoal.data.keys import StoreKeys
from shoal.keys import KeyStore, Scope
from shoal.keys.watch import PgListener

UPLOAD = "/api/v1/storage/upload"
REGISTRY = "/api/v1/models/registry"
NOTIFY_DEADLINE_S = 5.0


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


async def test_keys_of_the_key_database(
    stores: Callable[..., KeyStore],
    sqlite_url: str,
    start_store: StartStore,
    storage: Path,
    tiny_gguf: Path,
) -> None:
    database = stores(sqlite_url)
    keys = {scope: database.create(scope, f"{scope} key")[1] for scope in Scope}
    store = await start_store(storage, database=database, admin_key="")
    data = tiny_gguf.read_bytes()
    params = {"id": "db-upload", "sha256": hashlib.sha256(data).hexdigest()}

    for scope in Scope:  # every scope reads
        r = await store.client.get(REGISTRY, headers=_bearer(keys[scope]))
        assert r.status_code == 200, (scope, r.text)
    anonymous = await store.client.get(REGISTRY)
    assert anonymous.status_code == 401  # the database has read keys: reads are closed
    wrong = await store.client.get(REGISTRY, headers=_bearer("sk-nope"))
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"

    worker = await store.client.post(
        UPLOAD, params=params, headers=_bearer(keys[Scope.WORKER]), content=data
    )
    assert worker.status_code == 403 and worker.json()["error"]["code"] == "forbidden"
    assert "scope admin" in worker.json()["error"]["message"]
    admin = await store.client.post(
        UPLOAD, params=params, headers=_bearer(keys[Scope.ADMIN]), content=data
    )
    assert admin.status_code == 201, admin.text

    database.revoke(_id_of(database, Scope.ADMIN))
    revoked = await store.client.post(
        UPLOAD,
        params=params | {"overwrite": "true"},
        headers=_bearer(keys[Scope.ADMIN]),
        content=data,
    )
    assert revoked.status_code == 401 and "revoked" in revoked.json()["error"]["message"]
    # Every admin key revoked: uploads stay closed (revoking never opens), not disabled.
    anonymous_upload = await store.client.post(UPLOAD, params=params, content=data)
    assert anonymous_upload.status_code == 401


def _id_of(database: KeyStore, scope: Scope) -> str:
    return next(k.id for k in database.list() if k.scope == scope)


async def test_flag_keys_and_database_keys_together(
    stores: Callable[..., KeyStore],
    sqlite_url: str,
    start_store: StartStore,
    shared_storage: Path,
) -> None:
    database = stores(sqlite_url)
    _, worker_key = database.create(Scope.WORKER)
    store = await start_store(shared_storage, database=database, api_key="sk-flag-read")
    for secret in ("sk-flag-read", worker_key):
        assert (await store.client.get(REGISTRY, headers=_bearer(secret))).status_code == 200


async def test_a_revoke_elsewhere_reaches_the_store_at_once(
    stores: Callable[..., KeyStore],
    pg_url: str,
    start_store: StartStore,
    shared_storage: Path,
) -> None:
    """The store runs its key database's change watch as a router does: keys are cached, and a
    revoke by another process (NOTIFY) drops them at once."""
    database = stores(pg_url)
    store = await start_store(shared_storage, database=database)
    await asyncio.wait_for(database.wait_listening(), 10)
    watch = database.watch
    assert isinstance(watch, PgListener)
    count = watch.notifications
    key, secret = database.create(Scope.WORKER)
    await asyncio.wait_for(watch.wait_notified(count + 1), NOTIFY_DEADLINE_S)
    assert (await store.client.get(REGISTRY, headers=_bearer(secret))).status_code == 200
    lookups = database.db_lookups
    assert (await store.client.get(REGISTRY, headers=_bearer(secret))).status_code == 200
    assert database.db_lookups == lookups  # from the cache
    await asyncio.to_thread(stores(pg_url).revoke, key.id)  # another process's view
    await asyncio.wait_for(watch.wait_notified(count + 2), NOTIFY_DEADLINE_S)
    revoked = await store.client.get(REGISTRY, headers=_bearer(secret))
    assert revoked.status_code == 401 and "revoked" in revoked.json()["error"]["message"]


async def test_startup_problem_counts_the_key_database(
    stores: Callable[..., KeyStore], sqlite_url: str
) -> None:
    database = stores(sqlite_url)
    keys = StoreKeys(database=database, open_when_keyless=False)
    problem = keys.startup_problem("0.0.0.0")
    assert problem and "API keys" in problem and "admin keys" in problem
    database.create(Scope.WORKER)
    problem = keys.startup_problem("0.0.0.0")
    assert problem and "API keys" not in problem and "admin keys" in problem
    database.create(Scope.ADMIN)
    assert keys.startup_problem("0.0.0.0") is None
    assert "1 admin key" in await asyncio.to_thread(keys.describe, "0.0.0.0")


async def test_the_store_over_tls(
    start_store: StartStore, shared_storage: Path, certs: Certs, tiny_gguf: Path
) -> None:
    trusting = ssl.create_default_context(cafile=certs.ca)
    store = await start_store(
        shared_storage, tls_cert=certs.cert, tls_key=certs.key, verify=trusting
    )
    assert store.url.startswith("https://")
    assert (await store.client.get(REGISTRY)).status_code == 200
    data = tiny_gguf.read_bytes()
    params = {"id": "tls-upload", "sha256": hashlib.sha256(data).hexdigest()}
    r = await store.client.post(UPLOAD, params=params, content=data)
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    plain_url = store.url.replace("https://", "http://")
    async with httpx.AsyncClient(timeout=10) as plain:
        refused = await plain.get(plain_url + REGISTRY)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "tls_required"
    untrusting = ssl.create_default_context(cafile=certs.other_ca)
    async with httpx.AsyncClient(timeout=10, verify=untrusting) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(store.url + REGISTRY)
