"""Uploads over real HTTP: stored, then listed and pulled; every refusal leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from stores import ADMIN, ADMIN_KEY, MODEL_ID, TINY_ID, StartStore, StoreServer

from shoal.data.upload import FLUSH_BYTES
from shoal.models.store_client import fetch_ranges, request_pull
from shoal.pip_download import file_sha256

UPLOAD = "/api/v1/storage/upload"


async def _chunks(path: Path, size: int = 1 << 20) -> AsyncIterator[bytes]:
    """The file as a streamed (chunked) body, as a real client sends a large file."""
    with path.open("rb") as f:
        while chunk := f.read(size):
            yield chunk


async def test_upload_then_registry_then_pull(
    own_store: StoreServer, model_path: Path, tmp_path: Path
) -> None:
    sha = file_sha256(model_path)
    r = await own_store.client.post(
        UPLOAD,
        params={"id": "Uploaded-Model", "sha256": sha},
        headers=ADMIN,
        content=_chunks(model_path),
    )
    assert r.status_code == 201, r.text
    assert r.json() == {"id": "uploaded-model", "size": model_path.stat().st_size, "sha256": sha}
    assert (own_store.storage / "uploaded-model.gguf").read_bytes() == model_path.read_bytes()
    assert not [name for name in own_store.files() if name.startswith(".upload-")]

    registry = (await own_store.client.get("/api/v1/models/registry")).json()["data"]
    entry = next(e for e in registry if e["id"] == "uploaded-model")
    assert (entry["sha256"], entry["n_layers"], entry["quantization"]) == (sha, 30, "Q4_1")

    plan = await request_pull(own_store.url, "uploaded-model", 29, 29)
    assert plan.sha256 == sha
    sliced = (await fetch_ranges(own_store.url, plan, tmp_path / "tail.gguf")).read_bytes()
    original = model_path.read_bytes()
    assert all(sliced[a:b] == original[a:b] for a, b in plan.ranges)


async def test_upload_needs_an_admin_key(own_store: StoreServer, tiny_gguf: Path) -> None:
    params = {"id": "new", "sha256": file_sha256(tiny_gguf)}
    before = own_store.files()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"}):
        r = await own_store.client.post(
            UPLOAD, params=params, headers=headers, content=tiny_gguf.read_bytes()
        )
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert "admin key" in r.json()["error"]["message"]
    assert own_store.files() == before


async def test_uploads_are_disabled_without_an_admin_key(
    start_store: StartStore, storage: Path, tiny_gguf: Path
) -> None:
    own_store = await start_store(storage, admin_key="")
    r = await own_store.client.post(
        UPLOAD,
        params={"id": "new", "sha256": file_sha256(tiny_gguf)},
        headers=ADMIN,
        content=tiny_gguf.read_bytes(),
    )
    assert r.status_code == 403
    error = r.json()["error"]
    assert error["code"] == "uploads_disabled"
    assert "--admin-key" in error["message"]


async def test_sha256_mismatch_keeps_nothing(own_store: StoreServer, tiny_gguf: Path) -> None:
    before = own_store.files()
    r = await own_store.client.post(
        UPLOAD,
        params={"id": "new", "sha256": "0" * 64},
        headers=ADMIN,
        content=_chunks(tiny_gguf, 1000),
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("sha256_mismatch", "sha256")
    assert file_sha256(tiny_gguf) in error["message"]
    assert own_store.files() == before


async def test_over_the_limit_is_413_while_streaming(
    start_store: StartStore, storage: Path, tiny_gguf: Path
) -> None:
    own_store = await start_store(storage, max_upload_bytes=4096)
    before = own_store.files()
    params = {"id": "big", "sha256": file_sha256(tiny_gguf)}
    # chunked: no Content-Length, so the limit is enforced on the bytes as they arrive
    r = await own_store.client.post(
        UPLOAD, params=params, headers=ADMIN, content=_chunks(tiny_gguf, 1024)
    )
    assert r.status_code == 413
    assert "--max-upload-bytes" in r.json()["error"]["message"]
    assert own_store.files() == before
    # with a Content-Length over the limit, refused before any byte is read
    r = await own_store.client.post(
        UPLOAD, params=params, headers=ADMIN, content=tiny_gguf.read_bytes()
    )
    assert r.status_code == 413
    assert own_store.files() == before


async def test_not_a_gguf_keeps_nothing(own_store: StoreServer, tmp_path: Path) -> None:
    before = own_store.files()
    for name, data in [("text", b"hello, not a model\n" * 100), ("fake", b"GGUF" + b"\0" * 64)]:
        r = await own_store.client.post(
            UPLOAD,
            params={"id": name, "sha256": hashlib.sha256(data).hexdigest()},
            headers=ADMIN,
            content=data,
        )
        assert r.status_code == 400, name
        assert r.json()["error"]["code"] == "not_gguf"
        assert "nothing was kept" in r.json()["error"]["message"]
    assert own_store.files() == before


async def test_existing_id_is_409_unless_overwrite(own_store: StoreServer, tiny_gguf: Path) -> None:
    sha = file_sha256(tiny_gguf)
    r = await own_store.client.post(
        UPLOAD,
        params={"id": MODEL_ID, "sha256": sha},
        headers=ADMIN,
        content=tiny_gguf.read_bytes(),
    )
    assert r.status_code == 409
    assert "overwrite=true" in r.json()["error"]["message"]
    model = own_store.storage / f"{MODEL_ID}.gguf"
    assert model.stat().st_size == 98_362_432

    r = await own_store.client.post(
        UPLOAD,
        params={"id": MODEL_ID, "sha256": sha, "overwrite": "true"},
        headers=ADMIN,
        content=tiny_gguf.read_bytes(),
    )
    assert r.status_code == 201
    registry = (await own_store.client.get("/api/v1/models/registry")).json()["data"]
    entry = next(e for e in registry if e["id"] == MODEL_ID)
    assert (entry["sha256"], entry["n_layers"]) == (sha, 3)
    file = await own_store.client.get(f"/api/v1/models/{MODEL_ID}/file")
    assert file.headers["etag"] == f'"{sha}"'


async def test_bad_parameters_are_400(own_store: StoreServer, tiny_gguf: Path) -> None:
    sha = file_sha256(tiny_gguf)
    cases = [
        ({"id": "../escape", "sha256": sha}, "id"),
        ({"id": "tiny.gguf", "sha256": sha}, "id"),
        ({"id": "ok", "sha256": "xyz"}, "sha256"),
        ({"sha256": sha}, "id"),
    ]
    for params, param in cases:
        r = await own_store.client.post(
            UPLOAD, params=params, headers=ADMIN, content=tiny_gguf.read_bytes()
        )
        assert r.status_code == 400, params
        assert r.json()["error"]["param"] == param


async def test_admin_key_also_reads(start_store: StartStore, shared_storage: Path) -> None:
    store = await start_store(shared_storage, api_key="sk-read")
    r = await store.client.get(
        "/api/v1/models/registry", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert r.status_code == 200
    assert {e["id"] for e in r.json()["data"]} == {MODEL_ID, TINY_ID}


async def _eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_an_interrupted_upload_leaves_nothing(own_store: StoreServer) -> None:
    before = own_store.files()
    stalled = asyncio.Event()

    async def stalling_body() -> AsyncIterator[bytes]:
        yield b"GGUF" + b"\0" * (FLUSH_BYTES * 2)  # enough to reach the disk
        stalled.set()
        await asyncio.Event().wait()  # never finishes: the client gives up instead
        yield b""

    request = asyncio.create_task(
        own_store.client.post(
            UPLOAD,
            params={"id": "cut", "sha256": "0" * 64},
            headers=ADMIN,
            content=stalling_body(),
        )
    )
    await stalled.wait()
    await _eventually(lambda: own_store.files() != before, "the upload's temp file")
    assert [n for n in own_store.files() - before if n.startswith(".upload-")]
    request.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await request
    await _eventually(lambda: own_store.files() == before, "the temp file to be removed")
