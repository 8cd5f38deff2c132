"""Model stores for tests: the real app served by uvicorn on a free loopback port, in-process.

A store's folder holds a hardlink (or copy) of the real default model, named so its id is
``smollm2-135m-instruct``, and a tiny GGUF written with ``gguf.GGUFWriter``.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from stores import (
    ADMIN_KEY,
    MODEL_ID,
    TINY_ID,
    BodyBytes,
    StartStore,
    StoreServer,
    link_or_copy,
    write_tiny_gguf,
)

from shoal.data.app import bind, build_app, serve
from shoal.data.settings import DataSettings
from shoal.keys import KeyStore


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def _fill(folder: Path, model_path: Path, tiny_gguf: Path) -> Path:
    folder.mkdir()
    link_or_copy(model_path, folder / f"{MODEL_ID}.gguf")
    shutil.copyfile(tiny_gguf, folder / f"{TINY_ID}.gguf")
    return folder


@pytest.fixture
def storage(tmp_path: Path, model_path: Path, tiny_gguf: Path) -> Path:
    """A store folder of its own with the real default model and the tiny GGUF."""
    return _fill(tmp_path / "store", model_path, tiny_gguf)


@pytest.fixture(scope="session")
def shared_storage(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, tiny_gguf: Path
) -> Path:
    """Like ``storage`` but shared by tests that only read (hashed and parsed once)."""
    return _fill(tmp_path_factory.mktemp("shared") / "store", model_path, tiny_gguf)


@pytest.fixture
async def start_store() -> AsyncIterator[StartStore]:
    """Start real stores (uvicorn on a free loopback port); all stopped after the test."""
    tasks: list[asyncio.Task[None]] = []
    clients: list[httpx.AsyncClient] = []

    async def start(
        storage: Path, *, database: KeyStore | None = None, **overrides: Any
    ) -> StoreServer:
        """``database``: a key database whose keys count too. With ``tls_cert``/``tls_key``
        in ``overrides`` it serves HTTPS; pass ``verify`` (the CA) for its client."""
        verify = overrides.pop("verify", True)
        options: dict[str, Any] = {"api_key": "", "admin_key": ADMIN_KEY} | overrides
        settings = DataSettings(storage=storage, host="127.0.0.1", port=0, **options)
        sock = bind(settings.host, 0)
        port = sock.getsockname()[1]
        body = BodyBytes(build_app(settings, database))
        tasks.append(asyncio.create_task(serve(settings, sock, app=body, database=database)))
        scheme = "https" if settings.tls_cert else "http"
        url = f"{scheme}://127.0.0.1:{port}"
        client = httpx.AsyncClient(base_url=url, timeout=30, verify=verify)
        clients.append(client)
        return StoreServer(url, storage, settings, body, client)

    try:
        yield start
    finally:
        for client in clients:
            await client.aclose()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


@pytest.fixture
async def store(start_store: StartStore, shared_storage: Path) -> StoreServer:
    """A store over ``shared_storage`` (tests must not change it): reads open, uploads with
    ``ADMIN_KEY``."""
    return await start_store(shared_storage)


@pytest.fixture
async def own_store(start_store: StartStore, storage: Path) -> StoreServer:
    """A store over a folder of its own, for tests that upload or change files."""
    return await start_store(storage)
