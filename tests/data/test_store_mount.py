"""``--model-store-mount``: the store's folder seen at another path on each worker (NFS)."""

from __future__ import annotations

import shutil
from pathlib import Path

from stores import TINY_ID, StoreServer

from shoal.models.store_client import mounted_copy


async def test_each_worker_finds_the_file_at_its_own_mount_path(
    store: StoreServer, tmp_path: Path
) -> None:
    symlinked = tmp_path / "worker-a" / "mnt"  # the same folder at another path
    symlinked.parent.mkdir()
    symlinked.symlink_to(store.storage, target_is_directory=True)
    copied = tmp_path / "worker-b" / "models"  # a copied tree, as a sync would leave it
    shutil.copytree(store.storage, copied)
    for mount in (symlinked, copied):
        found = await mounted_copy(store.url, TINY_ID, mount)
        assert found == mount / f"{TINY_ID}.gguf"
        assert found.read_bytes() == (store.storage / f"{TINY_ID}.gguf").read_bytes()
    assert store.body.sent == 0  # nothing downloaded


async def test_a_missing_or_other_file_is_downloaded_instead(
    store: StoreServer, tmp_path: Path
) -> None:
    assert await mounted_copy(store.url, TINY_ID, tmp_path / "not-mounted") is None
    other = tmp_path / "stale"
    other.mkdir()
    (other / f"{TINY_ID}.gguf").write_bytes(b"GGUF an older version")
    assert await mounted_copy(store.url, TINY_ID, other) is None
