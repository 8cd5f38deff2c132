"""A router's embedded model store (``--storage``) checks keys by the store's own rule
(``shoal.data.keys.StoreKeys``), on the router's flag keys and key database."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from shoal.keys import KeyStore, Scope
from shoal.router.app import build_app
from shoal.router.settings import RouterSettings

REGISTRY = "/api/v1/models/registry"
UPLOAD = "/api/v1/storage/upload?id=m&sha256=" + "0" * 64


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def test_the_routers_keys_read_and_upload(
    tmp_path: Path, stores: Callable[..., KeyStore], sqlite_url: str
) -> None:
    database = stores(sqlite_url)
    _, worker = database.create(Scope.WORKER)
    _, inference = database.create(Scope.INFERENCE)
    _, admin = database.create(Scope.ADMIN)
    settings = RouterSettings(
        storage=tmp_path / "store", database_url=sqlite_url, gpu_key="sk-flag-gpu"
    )
    app = build_app(settings, database)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://r"
    ) as client:
        for secret in ("sk-flag-gpu", worker, inference, admin):
            assert (await client.get(REGISTRY, headers=_bearer(secret))).status_code == 200
        assert (await client.get(REGISTRY)).status_code == 401
        as_worker = await client.post(UPLOAD, headers=_bearer(worker), content=b"GGUF")
        assert as_worker.status_code == 403
        assert as_worker.json()["error"]["code"] == "forbidden"
        as_admin = await client.post(UPLOAD, headers=_bearer(admin), content=b"GGUF")
        assert as_admin.status_code == 400  # let in: the bytes are not the sha256 given
        assert as_admin.json()["error"]["code"] == "sha256_mismatch"


async def test_uploads_are_disabled_without_an_admin_key(
    tmp_path: Path, stores: Callable[..., KeyStore], sqlite_url: str
) -> None:
    database = stores(sqlite_url)
    app = build_app(RouterSettings(storage=tmp_path / "store", database_url=sqlite_url), database)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://r"
    ) as client:
        assert (await client.get(REGISTRY)).status_code == 200  # loopback, no keys: open
        r = await client.post(UPLOAD, content=b"GGUF")
        assert r.status_code == 403 and r.json()["error"]["code"] == "uploads_disabled"
