"""A stage of a split model pre-seeds from the model store's layer pull, not the whole file.

The real store over HTTP serves the pull plan and byte ranges (``worker.plan.layer_slice``);
the stage's RPC cache then holds the same entries, byte for byte, as when seeded from a full
local copy, and the store sent only that stage's share of the file.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from stores import TINY_ID, StartStore, StoreServer, link_or_copy

from shoal.hardware.detect import detect_machine
from shoal.llama_cpp.rpc_cache import RpcCache
from shoal.models.errors import ModelError
from shoal.pip_download import file_sha256
from shoal.protocol.ids import ModelName
from shoal.protocol.shards import ShardRole, ShardStart, StoreFile
from shoal.worker.settings import WorkerSettings
from shoal.worker.shards.rpc_seed import SeedOrder, seed
from shoal.worker.text.plan import layer_slice, stage_source


def _entries(cache: RpcCache) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in cache.entries()}


async def test_a_stage_seeds_from_the_stores_layer_pull(
    start_store: StartStore, big_gguf: Path, tmp_path: Path
) -> None:
    storage = tmp_path / "store"
    storage.mkdir()
    link_or_copy(big_gguf, storage / "big.gguf")
    store = await start_store(storage)
    settings = WorkerSettings(
        router_url="127.0.0.1:9", model_store=store.url, cache_dir=tmp_path / "cache"
    )

    sliced = await asyncio.to_thread(layer_slice, settings, "big", 2, 2)
    assert sliced is not None and sliced.stat().st_size == big_gguf.stat().st_size  # sparse
    pulled = store.body.sent
    assert pulled < big_gguf.stat().st_size / 2  # one layer of three, and the output

    from_store = RpcCache(tmp_path / "rpc-store", max_bytes=1 << 40)
    report = await asyncio.to_thread(seed, from_store, SeedOrder("d", sliced, 2, 2, True, "store"))
    local = RpcCache(tmp_path / "rpc-local", max_bytes=1 << 40)
    await asyncio.to_thread(seed, local, SeedOrder("d", big_gguf, 2, 2, True))
    assert report.source == "store" and report.tensors == 4
    assert _entries(from_store) == _entries(local)

    again = await asyncio.to_thread(layer_slice, settings, "big", 2, 2)
    assert again == sliced and store.body.sent == pulled  # kept: not fetched again
    assert await asyncio.to_thread(layer_slice, settings, str(big_gguf), 2, 2) is None


async def test_a_stage_told_the_routers_store_and_version(
    store: StoreServer, shared_storage: Path, tmp_path: Path
) -> None:
    """``ShardStart.store``: the stage pulls from the store the router found the model in (not
    its own ``--model-store``), and only the version the router planned with."""
    path = shared_storage / f"{TINY_ID}.gguf"
    pinned = StoreFile(
        url=store.url, id=TINY_ID, sha256=file_sha256(path), size=path.stat().st_size
    )
    settings = WorkerSettings(router_url="127.0.0.1:9", cache_dir=tmp_path / "cache")
    spec = ShardStart(
        deployment="d",
        role=ShardRole.STAGE,
        model=ModelName("d"),
        source=TINY_ID,
        ctx_size=256,
        layers=(1, 1),
        store=pinned,
    )
    machine = await asyncio.to_thread(detect_machine)
    sliced, kind = await asyncio.to_thread(stage_source, settings, spec, machine)
    assert kind == "store" and sliced.stat().st_size == path.stat().st_size
    other = spec.model_copy(update={"store": pinned.model_copy(update={"sha256": "ab" * 32})})
    with pytest.raises(ModelError, match="the router planned with"):
        await asyncio.to_thread(stage_source, settings, other, machine)
