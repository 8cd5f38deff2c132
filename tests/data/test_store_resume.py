"""Resumable uploads, the seed's multipart form and the upload client, over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from stores import ADMIN, ADMIN_KEY, StoreServer

from shoal.data.store import PARTIAL_UPLOAD_TTL_S, ModelStore
from shoal.data.upload import FLUSH_BYTES, partial_path
from shoal.models.errors import ModelError
from shoal.models.store_upload import upload_to_store
from shoal.pip_download import file_sha256

UPLOAD = "/api/v1/storage/upload"


async def _held(store: StoreServer, sha: str) -> int:
    r = await store.client.get(f"{UPLOAD}/{sha}", headers=ADMIN)
    assert r.status_code == 200, r.text
    held: int = r.json()["offset"]
    return held


async def _interrupt(store: StoreServer, data: bytes, sha: str, model_id: str) -> int:
    """Send ``data`` (the start of a file) as a resumable upload, then go away once the store
    has written some of it; the bytes the store holds after (what it had received)."""
    sent = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield data
        sent.set()
        await asyncio.Event().wait()  # the client gives up instead
        yield b""

    request = asyncio.create_task(
        store.client.post(
            UPLOAD,
            params={"id": model_id, "sha256": sha, "offset": 0},
            headers=ADMIN,
            content=body(),
        )
    )
    await sent.wait()
    deadline = asyncio.get_running_loop().time() + 10
    while _partial_bytes(store, sha) == 0:
        assert asyncio.get_running_loop().time() < deadline, "the store never wrote the bytes"
        await asyncio.sleep(0.02)
    request.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await request
    return await _held_after_release(store, sha)


async def _held_after_release(store: StoreServer, sha: str) -> int:
    """The offset once the store has let the broken upload go (it refuses a second one
    while the first still runs)."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        held = await _held(store, sha)
        probe = await store.client.post(
            UPLOAD, params={"id": "probe", "sha256": sha, "offset": held + 1}, headers=ADMIN
        )
        if probe.json()["error"]["code"] == "upload_offset_mismatch":
            return await _held(store, sha)  # none runs now: what it holds stays put
        assert asyncio.get_running_loop().time() < deadline, probe.text
        await asyncio.sleep(0.02)


def _partial_bytes(store: StoreServer, sha: str) -> int:
    path = partial_path(store.storage, sha)
    return path.stat().st_size if path.exists() else 0


async def test_an_interrupted_upload_resumes_where_the_store_stopped(
    own_store: StoreServer, model_path: Path
) -> None:
    data = model_path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    assert await _held(own_store, sha) == 0
    held = await _interrupt(own_store, data[: FLUSH_BYTES * 3], sha, "resumed")
    assert FLUSH_BYTES <= held <= FLUSH_BYTES * 3
    own_store.body.received = 0
    r = await own_store.client.post(
        UPLOAD,
        params={"id": "resumed", "sha256": sha, "offset": held},
        headers=ADMIN,
        content=data[held:],
    )
    assert r.status_code == 201, r.text
    assert r.json() == {"id": "resumed", "size": len(data), "sha256": sha}
    assert own_store.body.received == len(data) - held  # only the rest travelled
    assert file_sha256(own_store.storage / "resumed.gguf") == sha
    assert not partial_path(own_store.storage, sha).exists()


async def test_a_wrong_offset_is_409_and_says_where_to_resume(
    own_store: StoreServer, tiny_gguf: Path
) -> None:
    data = tiny_gguf.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    r = await own_store.client.post(
        UPLOAD, params={"id": "t", "sha256": sha, "offset": 10}, headers=ADMIN, content=data[10:]
    )
    assert r.status_code == 409
    error = r.json()["error"]
    assert error["code"] == "upload_offset_mismatch" and "offset=0" in error["message"]


async def test_a_resumed_upload_of_other_bytes_keeps_nothing(
    own_store: StoreServer, model_path: Path
) -> None:
    data = model_path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    held = await _interrupt(own_store, data[: FLUSH_BYTES * 2], sha, "spliced")
    before = own_store.files()
    other_tail = bytes(len(data) - held)  # the file changed between the two tries
    r = await own_store.client.post(
        UPLOAD,
        params={"id": "spliced", "sha256": sha, "offset": held},
        headers=ADMIN,
        content=other_tail,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "sha256_mismatch"
    assert "spliced.gguf" not in own_store.files()
    assert own_store.files() == before - {partial_path(own_store.storage, sha).name}


async def test_the_seeds_multipart_form(own_store: StoreServer, tiny_gguf: Path) -> None:
    data = tiny_gguf.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    before = own_store.files()
    r = await own_store.client.post(
        UPLOAD, headers=ADMIN, files={"file": ("Form-Model.gguf", data)}
    )
    assert r.status_code == 201, r.text
    assert r.json() == {"id": "form-model", "size": len(data), "sha256": sha}
    assert own_store.files() - before == {"form-model.gguf", ".form-model.gguf.sha256"}
    named = await own_store.client.post(
        UPLOAD,
        headers=ADMIN,
        files={"file": ("x.bin", data)},
        data={"id": "named", "sha256": sha},
    )
    assert named.status_code == 201 and named.json()["id"] == "named"


@pytest.mark.parametrize(
    ("form", "files", "code"),
    [
        ({"sha256": "0" * 64}, True, "sha256_mismatch"),
        ({"id": "no-file"}, False, None),
    ],
)
async def test_a_bad_form_keeps_nothing(
    own_store: StoreServer, tiny_gguf: Path, form: dict[str, str], files: bool, code: str | None
) -> None:
    before = own_store.files()
    r = await own_store.client.post(
        UPLOAD,
        headers=ADMIN,
        files={"file": ("bad.gguf", tiny_gguf.read_bytes())} if files else {"other": ("a", b"b")},
        data=form,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == code
    assert error["message"]
    assert own_store.files() == before


async def test_the_upload_client_resumes_and_checks_the_digest(
    own_store: StoreServer, model_path: Path
) -> None:
    data = model_path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    held = await _interrupt(own_store, data[: FLUSH_BYTES * 2], sha, "smol-client")
    done = await upload_to_store(
        own_store.url, model_path, model_id="smol-client", api_key=ADMIN_KEY
    )
    assert (done.id, done.size, done.sha256, done.resumed_from) == (
        "smol-client",
        len(data),
        sha,
        held,
    )
    again = await upload_to_store(
        own_store.url, model_path, model_id="smol-client", api_key=ADMIN_KEY, overwrite=True
    )
    assert again.resumed_from == 0
    with pytest.raises(ModelError, match="401.*--key"):
        await upload_to_store(own_store.url, model_path, model_id="x", api_key="sk-wrong")


@pytest.mark.parametrize("url", ["127.0.0.1:8100", "store.lan", "ftp://store.lan", "https://"])
async def test_the_upload_client_refuses_a_url_it_cannot_reach_before_hashing(
    url: str, tmp_path: Path
) -> None:
    missing = tmp_path / "never-read.gguf"  # refused before the file is even looked at
    with pytest.raises(ModelError, match="not a model store's URL.*https://store.lan:8100"):
        await upload_to_store(url, missing, api_key=ADMIN_KEY)


async def test_the_upload_client_waits_for_a_broken_try_to_let_go(
    own_store: StoreServer, model_path: Path
) -> None:
    """A try whose connection broke may still hold the upload at the store for a moment: the
    client's next try gets a 409 upload_in_progress, waits and goes on."""
    data = model_path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    sent = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield data[: FLUSH_BYTES * 2]
        sent.set()
        await asyncio.Event().wait()
        yield b""

    stalled = asyncio.create_task(
        own_store.client.post(
            UPLOAD, params={"id": "late", "sha256": sha, "offset": 0}, headers=ADMIN, content=body()
        )
    )
    await sent.wait()
    while _partial_bytes(own_store, sha) == 0:
        await asyncio.sleep(0.02)
    conflict = await own_store.client.post(
        UPLOAD, params={"id": "late", "sha256": sha, "offset": 0}, headers=ADMIN, content=b"x"
    )
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "upload_in_progress"
    asyncio.get_running_loop().call_later(0.5, stalled.cancel)
    done = await upload_to_store(own_store.url, model_path, model_id="late", api_key=ADMIN_KEY)
    assert done.sha256 == sha and done.resumed_from > 0
    with contextlib.suppress(asyncio.CancelledError):
        await stalled


def test_start_up_keeps_recent_resumable_uploads_only(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    recent, old = partial_path(tmp_path, "a" * 64), partial_path(tmp_path, "b" * 64)
    one_shot = tmp_path / ".upload-k2j3h4.part"
    for path in (recent, old, one_shot):
        path.write_bytes(b"GGUF")
    week_ago = time.time() - PARTIAL_UPLOAD_TTL_S - 60
    os.utime(old, (week_ago, week_ago))
    store.remove_partial_uploads()
    assert recent.exists() and not old.exists() and not one_shot.exists()
