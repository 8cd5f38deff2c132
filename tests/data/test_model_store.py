"""The store's parts: merging ranges, listing, the sha256 sidecar, settings, embedding."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from stores import TINY_ID, BodyBytes

from shoal.data.app import DataConfigError, bind, build_app, serve, store_keys
from shoal.data.errors import ModelNotFound
from shoal.data.keys import StoreKeys
from shoal.data.routes import install
from shoal.data.settings import DataSettings
from shoal.data.store import ModelStore
from shoal.models.byte_ranges import merge_ranges
from shoal.pip_download import file_sha256


@pytest.mark.parametrize(
    ("ranges", "gap", "merged"),
    [
        ([], 0, ()),
        ([(5, 10), (0, 5)], 0, ((0, 10),)),
        ([(0, 5), (6, 10)], 0, ((0, 5), (6, 10))),
        ([(0, 5), (6, 10)], 1, ((0, 10),)),
        ([(0, 10), (2, 4), (9, 12)], 0, ((0, 12),)),
        ([(3, 3), (7, 9)], 0, ((7, 9),)),  # empty ranges vanish
    ],
)
def test_merge_ranges(
    ranges: list[tuple[int, int]], gap: int, merged: tuple[tuple[int, int], ...]
) -> None:
    assert merge_ranges(ranges, max_gap=gap) == merged


def test_listing_and_lookup(storage: Path) -> None:
    (storage / "Mixed.Case.GGUF").write_bytes((storage / f"{TINY_ID}.gguf").read_bytes())
    (storage / ".hidden.gguf").write_bytes(b"GGUF")
    (storage / "folder.gguf").mkdir()
    store = ModelStore(storage)
    assert [m.id for m in store.models()] == ["mixed.case", "smollm2-135m-instruct", "tiny"]
    assert store.get("MIXED.case").filename == "Mixed.Case.GGUF"
    with pytest.raises(ModelNotFound, match="tiny"):
        store.get("absent")


def test_sha256_is_computed_once_and_kept_in_a_sidecar(storage: Path) -> None:
    path = storage / f"{TINY_ID}.gguf"
    model = ModelStore(storage).get(TINY_ID)
    assert ModelStore(storage).sha256(model) == file_sha256(path)
    sidecar = storage / f".{TINY_ID}.gguf.sha256"
    assert sidecar.is_file()
    # A new store trusts the sidecar while size and mtime match: it does not hash again.
    sidecar.write_text(sidecar.read_text().replace(file_sha256(path), "ab" * 32))
    assert ModelStore(storage).sha256(model) == "ab" * 32
    # A touched file no longer matches its sidecar and is hashed again.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert ModelStore(storage).sha256(ModelStore(storage).get(TINY_ID)) == file_sha256(path)
    assert file_sha256(path) in sidecar.read_text()


def test_leftover_uploads_are_removed(storage: Path) -> None:
    (storage / ".upload-x-123.part").write_bytes(b"GGUF...")
    ModelStore(storage).remove_partial_uploads()
    assert not (storage / ".upload-x-123.part").exists()


def test_startup_problem(tmp_path: Path) -> None:
    base = {"storage": tmp_path, "api_key": "", "admin_key": ""}
    assert store_keys(DataSettings(**base), None).startup_problem("127.0.0.1") is None
    open_lan = DataSettings(**{**base, "host": "0.0.0.0"})
    problem = store_keys(open_lan, None).startup_problem(open_lan.host)
    assert problem is not None
    assert "--api-key" in problem and "--admin-key" in problem
    with pytest.raises(DataConfigError, match="refusing to listen on 0.0.0.0"):
        build_app(open_lan)
    keyed = DataSettings(**{**base, "host": "0.0.0.0", "api_key": "a,b", "admin_key": "c"})
    assert store_keys(keyed, None).startup_problem(keyed.host) is None
    assert len(keyed.api_key) == 2


def test_every_setting_is_described() -> None:
    fields = DataSettings.model_fields
    assert {"storage", "host", "port", "admin_key", "api_key", "max_upload_bytes"} <= set(fields)
    assert all(info.description for info in fields.values())
    assert fields["port"].default == 8100
    assert fields["max_upload_bytes"].default == 256 * 1024**3


async def test_routes_embed_into_another_app(storage: Path) -> None:
    host_app = FastAPI()

    @host_app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    install(host_app, ModelStore(storage), access=StoreKeys())
    settings = DataSettings(storage=storage, api_key="", admin_key="")
    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    task = asyncio.create_task(serve(settings, sock, app=BodyBytes(host_app)))
    try:
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/health")).json() == {"status": "ok"}
            registry = (await client.get("/api/v1/models/registry")).json()
            assert TINY_ID in {e["id"] for e in registry["data"]}
            missing = await client.get("/api/v1/models/nope/metadata")
            assert (missing.status_code, missing.json()["error"]["code"]) == (
                404,
                "model_not_found",
            )
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
