"""The deployments API on a model-store id: found in the router's own store, 404 when in no
store (naming those asked), 503 when a store that might have it cannot be asked; a refused
deploy leaves nothing behind.

The router's app (``build_app``, in-process queue) with ``--storage`` holding the real default
model under an id no catalog knows, and one worker without a socket (``socketless``) to plan
over; requests go through the app with httpx.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from shoal.pip_download import file_sha256
from shoal.router.app import RouterConfigError, build_app
from shoal.router.settings import RouterSettings
from socketless import worker_connection

STORE_ID = "smol-in-store"

Client = Callable[..., httpx.AsyncClient]


def _down() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def storage(tmp_path: Path, model_path: Path) -> Path:
    folder = tmp_path / "storage"
    folder.mkdir()
    os.link(model_path, folder / f"{STORE_ID}.gguf")
    return folder


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[Client]:
    clients: list[httpx.AsyncClient] = []

    def make(**options: object) -> httpx.AsyncClient:
        settings = RouterSettings(
            database_url=f"sqlite:///{tmp_path}/keys.db", cache_dir=tmp_path / "cache", **options
        )
        app = build_app(settings)
        app.ctx.registry.add(worker_connection("w", ram_bytes=8 << 30))  # a worker to plan over
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r")
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()


async def test_a_model_in_the_routers_own_store(
    router: Client, storage: Path, model_path: Path
) -> None:
    client = router(storage=storage)
    r = await client.post("/api/v1/pipeline/plan", json={"model": STORE_ID})
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["model"] == STORE_ID and plan["n_layers"] == 30
    assert plan["store"] == {
        "url": None,  # the router's own: workers reach it at the router's URL
        "id": STORE_ID,
        "sha256": file_sha256(model_path),
        "size": model_path.stat().st_size,
    }


async def test_in_no_store_is_a_404_naming_the_stores_asked(router: Client, storage: Path) -> None:
    client = router(storage=storage)
    for path in ("/api/v1/pipeline/plan", "/api/v1/pipeline/deploy"):
        r = await client.post(path, json={"model": "no-such-model"})
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "the router's own store (--storage)" in error["message"]
    assert (await client.get("/api/v1/pipeline/status")).json()["data"] == []


async def test_a_store_that_cannot_be_asked_is_a_503(router: Client, storage: Path) -> None:
    down = _down()
    client = router(storage=storage, model_store=(down,))
    for path in ("/api/v1/pipeline/plan", "/api/v1/pipeline/deploy"):
        r = await client.post(path, json={"model": "no-such-model"})
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "model_store_unavailable" and down in error["message"]
    assert (await client.get("/api/v1/pipeline/status")).json()["data"] == []
    # the router's own store answers first: the store that is down is not asked for its model
    r = await client.post("/api/v1/pipeline/plan", json={"model": STORE_ID})
    assert r.status_code == 200, r.text


def test_the_stores_setting_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_ROUTER_MODEL_STORE", "http://a:8001, https://b:8001")
    monkeypatch.setenv("SHOAL_MODEL_STORE", "http://worker-only:1")  # a worker's, not read
    settings = RouterSettings()
    assert settings.model_store == ("http://a:8001", "https://b:8001")


def test_a_model_store_ca_that_is_not_a_certificate_stops_the_router(tmp_path: Path) -> None:
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    settings = RouterSettings(
        database_url=f"sqlite:///{tmp_path}/keys.db", model_store_ca=bad, model_store=("x",)
    )
    with pytest.raises(RouterConfigError, match="--model-store-ca"):
        build_app(settings)
