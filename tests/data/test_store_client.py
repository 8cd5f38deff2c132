"""``fetch_from_store`` against a real store: whole, resumed, verified, and its errors."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from stores import MODEL_ID, READ_KEY, StartStore, StoreServer

from shoal.models.errors import ModelError
from shoal.models.store_client import fetch_from_store
from shoal.pip_download import file_sha256


async def test_fetches_the_whole_file(store: StoreServer, model_path: Path, tmp_path: Path) -> None:
    dest = tmp_path / "models"
    path = await fetch_from_store(store.url, MODEL_ID, dest)
    assert path == dest / f"{MODEL_ID}.gguf"
    assert file_sha256(path) == file_sha256(model_path)
    assert store.body.sent == model_path.stat().st_size
    assert sorted(p.name for p in dest.iterdir()) == [path.name]

    store.body.sent = 0
    assert await fetch_from_store(store.url, MODEL_ID.upper(), dest) == path
    assert store.body.sent == 0  # complete and verified: nothing downloaded again


async def test_resumes_a_partial_download(
    store: StoreServer, model_path: Path, tmp_path: Path
) -> None:
    kept = 40_000_123
    dest = tmp_path / "models"
    dest.mkdir()
    part = dest / f"{MODEL_ID}.gguf.part"
    with model_path.open("rb") as f:
        part.write_bytes(f.read(kept))
    path = await fetch_from_store(store.url, MODEL_ID, dest)
    assert store.body.sent == model_path.stat().st_size - kept  # only the rest crossed the wire
    assert file_sha256(path) == file_sha256(model_path)
    assert not part.exists()


async def test_a_damaged_part_is_caught_and_deleted(
    store: StoreServer, model_path: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "models"
    dest.mkdir()
    part = dest / f"{MODEL_ID}.gguf.part"
    part.write_bytes(b"\xff" * 1_000_000)
    with pytest.raises(ModelError, match="sha256") as caught:
        await fetch_from_store(store.url, MODEL_ID, dest)
    assert "Run the download again" in str(caught.value)
    assert list(dest.iterdir()) == []
    # the next run starts from scratch and succeeds
    path = await fetch_from_store(store.url, MODEL_ID, dest)
    assert file_sha256(path) == file_sha256(model_path)


async def test_unknown_model(store: StoreServer, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not in the model store") as caught:
        await fetch_from_store(store.url, "no-such-model", tmp_path / "models")
    assert MODEL_ID in str(caught.value)
    assert not (tmp_path / "models").exists()


async def test_unreachable_store(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ModelError, match="cannot reach the model store"):
        await fetch_from_store(f"http://127.0.0.1:{port}", MODEL_ID, tmp_path)


async def test_api_key(start_store: StartStore, shared_storage: Path, tmp_path: Path) -> None:
    store = await start_store(shared_storage, api_key=READ_KEY)
    with pytest.raises(ModelError, match="API key"):
        await fetch_from_store(store.url, "tiny", tmp_path / "models")
    path = await fetch_from_store(store.url, "tiny", tmp_path / "models", api_key=READ_KEY)
    assert path.read_bytes() == (shared_storage / "tiny.gguf").read_bytes()


async def test_a_part_of_another_version_starts_over(
    store: StoreServer, model_path: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "models"
    dest.mkdir()
    with model_path.open("rb") as f:
        (dest / f"{MODEL_ID}.gguf.part").write_bytes(f.read(1_000_000))
    (dest / f"{MODEL_ID}.gguf.part.sha256").write_text("ab" * 32)  # an older version's part
    path = await fetch_from_store(store.url, MODEL_ID, dest)
    assert store.body.sent == model_path.stat().st_size  # nothing of the old part was kept
    assert file_sha256(path) == file_sha256(model_path)
    assert [p.name for p in dest.iterdir()] == [path.name]
