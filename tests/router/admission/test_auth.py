"""The router's key checks on the real key store: scopes, the open-on-loopback rule, and a key
database that fails (503, never an open door)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest
from pydantic import SecretStr
from starlette.datastructures import Headers

from shoal.keys import KeyStore, Priority, Queueing, Scope, open_store
from shoal.router.admission.auth import OPEN, KeyCheck
from shoal.router.dispatch.fair_queue import Tenant
from shoal.router.errors import Forbidden, Unauthorized, Unavailable
from shoal.router.routes.common import tenant

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"


def bearer(key: str) -> Headers:
    return Headers({"authorization": f"Bearer {key}"})


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KeyStore]:
    opened = open_store(f"sqlite:///{tmp_path / 'keys.db'}")
    yield opened
    opened.close()


async def test_scopes_and_flags(store: KeyStore) -> None:
    keys = KeyCheck(
        api_keys=(SecretStr("flag-key"),), gpu_keys=(), store=store, open_when_keyless=True
    )
    _, inference = store.create(Scope.INFERENCE, "app")
    record, admin = store.create(Scope.ADMIN, "ops")
    _, worker = store.create(Scope.WORKER, "gpus")
    assert (await keys.client(bearer(inference))).name == "app"
    assert (await keys.client(bearer(admin))).key_id == record.id  # admin may call inference
    assert (await keys.client(bearer("flag-key"))).key_id is None
    # A known key of another scope: 403, saying what it is and what the route needs.
    with pytest.raises(Forbidden, match="is a worker key; this route needs an inference or admin"):
        await keys.client(bearer(worker))  # a GPU key is not an API key
    with pytest.raises(Forbidden, match="is an inference key; this route needs an admin key"):
        await keys.admin(bearer(inference))
    with pytest.raises(Unauthorized, match="Incorrect admin key"):
        await keys.admin(bearer("ak-shoal-not-a-key"))
    assert await keys.worker(bearer(worker)) and not await keys.worker(bearer(inference))


async def test_a_keys_weight_class_and_cap_reach_the_tenant_its_requests_queue_for(
    store: KeyStore,
) -> None:
    keys = KeyCheck(api_keys=(SecretStr("flag-key"),), gpu_keys=(), store=store)
    etl, etl_secret = store.create(Scope.INFERENCE, "etl", None, Queueing(3.0, Priority.BATCH, 2))
    ops, ops_secret = store.create(Scope.ADMIN, "ops")
    assert tenant(await keys.client(bearer(etl_secret))) == Tenant(etl.id, 3.0, Priority.BATCH, 2)
    assert tenant(await keys.client(bearer(ops_secret))) == Tenant(ops.id)  # defaults
    flag = tenant(await keys.client(bearer("flag-key")))
    assert (flag.weight, flag.priority, flag.max_queued) == (1.0, Priority.INTERACTIVE, None)
    # `shoal keys update` reaches the next request (the cache is dropped on the change).
    store.update(etl.id, lambda k: replace(k, queueing=Queueing(0.5)))
    assert tenant(await keys.client(bearer(etl_secret))) == Tenant(etl.id, 0.5)


async def test_flag_keys_of_another_scope_are_403(store: KeyStore) -> None:
    keys = KeyCheck(
        api_keys=(SecretStr("api-flag"),),
        gpu_keys=(SecretStr("gpu-flag"),),
        admin_keys=(SecretStr("admin-flag"),),
        store=store,
        open_when_keyless=True,
    )
    with pytest.raises(Forbidden, match="is an inference key; this route needs an admin key"):
        await keys.admin(bearer("api-flag"))
    with pytest.raises(Forbidden, match="is a worker key"):
        await keys.client(bearer("gpu-flag"))
    assert (await keys.admin(bearer("admin-flag"))).key_id is None
    with pytest.raises(Unauthorized):
        await keys.admin(bearer("not-a-flag"))
    without_store = KeyCheck(
        api_keys=(SecretStr("api-flag"),), gpu_keys=(), admin_keys=(SecretStr("admin-flag"),)
    )
    with pytest.raises(Forbidden, match="is an inference key"):
        await without_store.admin(bearer("api-flag"))


async def test_open_only_on_loopback_and_only_while_keyless(store: KeyStore) -> None:
    local = KeyCheck(api_keys=(), gpu_keys=(), store=store, open_when_keyless=True)
    assert await local.client(bearer("anything")) is OPEN
    assert await local.open_scopes() == [Scope.INFERENCE, Scope.WORKER, Scope.ADMIN]
    remote = KeyCheck(api_keys=(), gpu_keys=(), store=store, open_when_keyless=False)
    with pytest.raises(Forbidden, match="shoal keys create --scope admin"):
        await remote.admin(Headers({}))
    assert await remote.open_scopes() == []
    store.create(Scope.INFERENCE, "first")  # a key now exists: the open door closes at once
    with pytest.raises(Unauthorized):
        await local.client(bearer("anything"))
    assert await local.open_scopes() == [Scope.WORKER, Scope.ADMIN]


async def test_revoking_every_key_closes_the_loopback_door(store: KeyStore) -> None:
    local = KeyCheck(api_keys=(), gpu_keys=(), store=store, open_when_keyless=True)
    key, secret = store.create(Scope.INFERENCE, "only")
    assert (await local.client(bearer(secret))).key_id == key.id
    store.revoke(key.id)
    with pytest.raises(Unauthorized, match=rf"This key \({key.prefix}\.\.\.\) was revoked"):
        await local.client(bearer(secret))
    with pytest.raises(Unauthorized, match="Incorrect API key"):
        await local.client(bearer("anything"))
    with pytest.raises(Unauthorized, match="No API key given"):
        await local.client(Headers({}))


@pytest.fixture
def pg_store() -> Iterator[tuple[KeyStore, str]]:
    schema = f"shoal_auth_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    opened = open_store(f"{PG_ADMIN}?options=-csearch_path%3D{schema}")
    try:
        yield opened, schema
    finally:
        opened.close()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def test_a_failing_key_database_is_a_503_not_an_open_door(
    pg_store: tuple[KeyStore, str],
) -> None:
    store, schema = pg_store
    keys = KeyCheck(api_keys=(), gpu_keys=(), store=store, open_when_keyless=True)
    store.create(Scope.INFERENCE, "app")
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')  # the database breaks under the router
    with pytest.raises(Unavailable) as caught:
        await keys.client(bearer("sk-shoal-not-a-cached-key"))
    assert caught.value.status == 503 and caught.value.headers["Retry-After"] == "5"
    assert "key database is unreachable" in caught.value.message
