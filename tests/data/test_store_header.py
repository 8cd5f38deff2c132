"""A split model's structure read from model stores by its header alone (``ModelSources``).

Real stores (uvicorn on loopback) over the tiny GGUF and the real default model: the planner's
``GGUFInfo`` comes from HTTP ``Range`` reads of the header, never the tensor data, and equals
the one parsed from the file itself; the id is looked up across stores in order; the errors
say which stores were asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import ssl
from pathlib import Path

import pytest
from stores import ADMIN_KEY, MODEL_ID, READ_KEY, TINY_ID, StartStore, StoreServer

from certs import make_certs
from shoal import serving
from shoal.data.app import bind, build_app
from shoal.data.settings import DataSettings
from shoal.data.store import ModelStore
from shoal.models.errors import ModelError, StoreUnreachable
from shoal.models.gguf_header import HEADER_CHUNK
from shoal.models.gguf_info import GGUFInfo, inspect
from shoal.models.store_client import fetch_from_store, fetch_header, find_entry
from shoal.pip_download import file_sha256
from shoal.protocol.messages import StoreFile
from shoal.router.deployments.sources import ModelSources


def _same(a: GGUFInfo, b: GGUFInfo) -> None:
    """Equal but for where each was parsed from."""
    assert dataclasses.replace(a, path=Path("x")) == dataclasses.replace(b, path=Path("x"))


def _free_port() -> int:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_the_header_alone_gives_the_files_structure(
    store: StoreServer, shared_storage: Path, tmp_path: Path
) -> None:
    sources = ModelSources(tmp_path, [store.url])
    located = await sources.locate(TINY_ID)
    path = shared_storage / f"{TINY_ID}.gguf"
    _same(located.info, inspect(path))
    assert located.info.path == Path(f"{TINY_ID}.gguf")  # the store's name, not a temp file
    assert located.store == StoreFile(
        url=store.url, id=TINY_ID, sha256=file_sha256(path), size=path.stat().st_size
    )
    assert located.where() == store.url
    assert store.body.sent == min(HEADER_CHUNK, path.stat().st_size)  # one range request

    sent = store.body.sent
    again = await sources.locate(TINY_ID.upper())
    assert again == located
    assert store.body.sent == sent  # parsed once per store and sha256: only the registry asked


async def test_the_real_model_by_its_header(
    store: StoreServer, model_path: Path, tmp_path: Path
) -> None:
    located = await ModelSources(tmp_path, [store.url]).locate(MODEL_ID)
    _same(located.info, inspect(model_path))
    assert store.body.sent < model_path.stat().st_size // 20  # a few MiB of ~100 MiB


async def test_fetch_header_ends_where_the_data_starts(
    store: StoreServer, shared_storage: Path
) -> None:
    entry = await find_entry(store.url, TINY_ID)
    assert entry is not None
    header = await fetch_header(store.url, entry)
    data = (shared_storage / f"{TINY_ID}.gguf").read_bytes()
    assert data.startswith(header)
    assert inspect(shared_storage / f"{TINY_ID}.gguf").tensors[0].offset >= len(header)
    assert await find_entry(store.url, "no-such-model") is None


async def test_the_first_store_that_has_it(
    start_store: StartStore, shared_storage: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    first = await start_store(empty)
    second = await start_store(shared_storage)
    located = await ModelSources(tmp_path, [first.url, second.url + "/"]).locate(TINY_ID)
    assert located.store is not None and located.store.url == second.url


async def test_in_no_store_names_the_stores_asked(
    start_store: StartStore, store: StoreServer, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    other = await start_store(empty)
    with pytest.raises(ModelError) as caught:
        await ModelSources(tmp_path, [store.url, other.url]).locate("no-such-model")
    assert not isinstance(caught.value, StoreUnreachable)  # a 404, not a 503
    message = str(caught.value)
    assert store.url in message and other.url in message and "--model-store" in message


async def test_an_unreachable_store_is_not_a_missing_model(
    store: StoreServer, tmp_path: Path
) -> None:
    down = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(StoreUnreachable) as caught:
        await ModelSources(tmp_path, [down, store.url]).locate("no-such-model")
    assert down in str(caught.value)
    # one store down does not hide a model another has
    located = await ModelSources(tmp_path, [down, store.url]).locate(TINY_ID)
    assert located.store is not None and located.store.url == store.url


async def test_the_routers_key_for_the_stores(
    start_store: StartStore, shared_storage: Path, tmp_path: Path
) -> None:
    keyed = await start_store(shared_storage, api_key=READ_KEY)
    with pytest.raises(ModelError, match="API key") as caught:
        await ModelSources(tmp_path, [keyed.url]).locate(TINY_ID)
    assert not isinstance(caught.value, StoreUnreachable)
    located = await ModelSources(tmp_path, [keyed.url], api_key=READ_KEY).locate(TINY_ID)
    assert located.id == TINY_ID


async def test_a_path_or_the_routers_own_store_is_read_here(
    shared_storage: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    down = f"http://127.0.0.1:{_free_port()}"  # never asked: found before
    own = ModelStore(shared_storage)
    sources = ModelSources(tmp_path, [down], own_store=own)
    by_path = await sources.locate(str(tiny_gguf))
    assert by_path.store is None and by_path.where() == "router"
    in_own = await sources.locate(TINY_ID)
    path = shared_storage / f"{TINY_ID}.gguf"
    assert in_own.store == StoreFile(
        url=None, id=TINY_ID, sha256=file_sha256(path), size=path.stat().st_size
    )
    assert in_own.where() == "router store"
    with pytest.raises(ModelError, match="no-such.gguf"):  # a path is never looked up in stores
        await sources.locate(str(tmp_path / "no-such.gguf"))


async def test_a_download_pinned_to_another_version_is_refused(
    store: StoreServer, tmp_path: Path
) -> None:
    with pytest.raises(ModelError, match="the router planned with") as caught:
        await fetch_from_store(store.url, TINY_ID, tmp_path / "models", sha256="ab" * 32)
    assert "deploy it again" in str(caught.value)
    assert store.body.sent == 0


async def test_an_https_store_is_verified_with_the_ca_given(
    shared_storage: Path, tmp_path: Path
) -> None:
    """The router's ``--model-store-ca``: a store's certificate is checked against it."""
    certs = make_certs(tmp_path / "certs")
    settings = DataSettings(
        storage=shared_storage, host="127.0.0.1", port=0, api_key="", admin_key=ADMIN_KEY
    )
    sock = bind(settings.host, 0)
    url = f"https://127.0.0.1:{sock.getsockname()[1]}"
    tls = serving.TlsFiles(certs.cert, certs.key)
    server = serving.build_server(build_app(settings), tls=tls)
    task = asyncio.create_task(serving.serve_on(server, sock))
    try:
        trusted = ssl.create_default_context(cafile=certs.ca)
        located = await ModelSources(tmp_path, [url], tls=trusted).locate(TINY_ID)
        assert located.store is not None and located.store.url == url
        other = ssl.create_default_context(cafile=certs.other_ca)
        with pytest.raises(StoreUnreachable, match="certificate verify failed"):
            await ModelSources(tmp_path, [url], tls=other).locate(TINY_ID)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
