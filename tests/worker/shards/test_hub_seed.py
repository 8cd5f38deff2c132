"""A split model's stage pre-seeds from Hugging Face with HTTP Range, and every shard uses the
one file the router pinned.

The Hub here is a FAKE on loopback that speaks Hugging Face's protocol (``fakes.fake_hub``:
the resolve redirect, the download host with ``Range``, and a count of the bytes it sent),
serving the generated big-tensor GGUF (``big_gguf.py``) under a catalog model's file name.
The stage's RPC cache must then hold, byte for byte, what seeding from a full local copy
gives (which ``tests/llama_cpp/test_rpc_cache.py`` proves is what ``ggml-rpc-server`` names),
having fetched only its layers' share of the file and the header.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from data.stores import link_or_copy
from fakes.fake_hub import FakeHub
from shoal.hardware.profile import MachineProfile
from shoal.llama_cpp.rpc_cache import RpcCache
from shoal.models.catalog_file import load_catalog
from shoal.models.default import DEFAULT_MODEL
from shoal.models.errors import HubError
from shoal.models.gguf_header import HEADER_CHUNK
from shoal.models.gguf_info import inspect
from shoal.models.hub_cache import local_path
from shoal.models.stage_tensors import stage_tensors
from shoal.protocol.messages import ModelFile, ModelName, ShardRole, ShardStart
from shoal.router.deployments.pin import pin_model
from shoal.worker import hardware
from shoal.worker.settings import WorkerSettings
from shoal.worker.shards.rpc_seed import SeedOrder, seed
from shoal.worker.text.plan import local_model, pinned_model, stage_source

MODEL = "llama-3.3-70b-instruct"
"""A catalog model no quantization of which fits here by the catalog's sizes, and whose
entry lists no sha256 (so the generated GGUF can stand in for one of its files)."""
PINNED, OTHER = "Q2_K", "IQ3_M"


def _file_of(quantization: str) -> str:
    entry = load_catalog().get(MODEL)
    assert entry is not None
    quant = entry.hub.quant(quantization)
    assert quant is not None and not quant.sha256
    return quant.files[0]


def _repo() -> str:
    entry = load_catalog().get(MODEL)
    assert entry is not None
    return entry.hub.repo


@pytest.fixture
def hub(big_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with FakeHub.start({(_repo(), _file_of(PINNED)): big_gguf}) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield fake


@pytest.fixture(scope="module")
def machine() -> MachineProfile:
    return hardware.detect_profile()


def _settings(cache: Path) -> WorkerSettings:
    return WorkerSettings(router_url="127.0.0.1:9", cache_dir=cache)


def _place(cache: Path, quantization: str, gguf: Path) -> Path:
    """``gguf`` in ``cache`` as if downloaded as ``quantization`` of the catalog model."""
    path = local_path(cache, _repo(), _file_of(quantization))
    path.parent.mkdir(parents=True, exist_ok=True)
    link_or_copy(gguf, path)
    return path


def _pin(big_gguf: Path, size: int | None = None) -> ModelFile:
    return ModelFile(
        source=MODEL,
        kind="hub",
        quantization=PINNED,
        repo=_repo(),
        filename=_file_of(PINNED),
        revision="main",
        size=size if size is not None else big_gguf.stat().st_size,
    )


def _stage(file: ModelFile, first: int, last: int, output: bool) -> ShardStart:
    return ShardStart(
        deployment="d",
        role=ShardRole.STAGE,
        model=ModelName("d"),
        source=MODEL,
        ctx_size=512,
        layers=(first, last),
        output=output,
        file=file,
    )


def _entries(cache: RpcCache) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in cache.entries()}


async def test_a_stage_seeds_from_the_hub_with_range_requests(
    hub: FakeHub, big_gguf: Path, machine: MachineProfile, tmp_path: Path
) -> None:
    settings = _settings(tmp_path / "stage")
    info = inspect(big_gguf)
    size = big_gguf.stat().st_size
    for first, last, output in ((1, 1, False), (2, 2, True)):
        before = hub.sent(_repo(), _file_of(PINNED))
        spec = _stage(_pin(big_gguf), first, last, output)
        path, kind = await asyncio.to_thread(stage_source, settings, spec, machine)
        fetched = hub.sent(_repo(), _file_of(PINNED)) - before
        assert kind == "hub"
        share = sum(t.nbytes for t in stage_tensors(info, first, last, output))
        # Its layers' hashed tensors and the header (asked for a chunk at a time), no more.
        assert share < fetched <= share + info.data_offset + HEADER_CHUNK, (fetched, share)
        assert fetched < size / 2

        from_hub = RpcCache(tmp_path / f"rpc-hub-{first}", max_bytes=1 << 40)
        report = await asyncio.to_thread(
            seed, from_hub, SeedOrder("d", path, first, last, output, kind)
        )
        local = RpcCache(tmp_path / f"rpc-local-{first}", max_bytes=1 << 40)
        await asyncio.to_thread(seed, local, SeedOrder("d", big_gguf, first, last, output))
        assert report.source == "hub" and report.bytes == share and report.error is None
        assert _entries(from_hub) == _entries(local)  # what ggml-rpc-server would name

        # A redeploy finds the slice: no request at all.
        hub.clear_requests()
        again = await asyncio.to_thread(stage_source, settings, spec, machine)
        assert again == (path, "hub") and hub.requests == []


async def test_offline_a_stage_fetches_nothing_from_the_hub(
    hub: FakeHub,
    big_gguf: Path,
    machine: MachineProfile,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = _stage(_pin(big_gguf), 1, 1, False)
    offline = _settings(tmp_path / "stage").model_copy(update={"offline": True})
    with pytest.raises(HubError, match="offline"):
        await asyncio.to_thread(stage_source, offline, spec, machine)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="HF_HUB_OFFLINE"):
        await asyncio.to_thread(stage_source, _settings(tmp_path / "s2"), spec, machine)
    assert hub.requests == []


async def test_a_changed_file_on_the_hub_is_not_seeded_from(
    hub: FakeHub, big_gguf: Path, machine: MachineProfile, tmp_path: Path
) -> None:
    spec = _stage(_pin(big_gguf, size=big_gguf.stat().st_size + 1), 1, 1, False)
    with pytest.raises(HubError, match="the file changed"):
        await asyncio.to_thread(stage_source, _settings(tmp_path / "stage"), spec, machine)
    assert hub.sent(_repo(), _file_of(PINNED)) == 0


async def test_router_head_and_stages_agree_on_the_pinned_file(
    hub: FakeHub, big_gguf: Path, model_path: Path, machine: MachineProfile, tmp_path: Path
) -> None:
    """The router has one quantization; head and stage have another, which their own fit
    would choose (a smaller file fits better here). With the pin, both use the router's."""
    router_cache = tmp_path / "router"
    _place(router_cache, PINNED, big_gguf)
    pinned = await asyncio.to_thread(pin_model, MODEL, router_cache)
    assert pinned == _pin(big_gguf)

    head, stage = _settings(tmp_path / "head"), _settings(tmp_path / "stage")
    for settings in (head, stage):
        theirs = _place(settings.cache_dir, OTHER, model_path)
        offline = settings.model_copy(update={"offline": True})
        own = await asyncio.to_thread(local_model, offline, MODEL, machine)
        assert own.path == theirs and own.quantization == OTHER  # what they would pick

    path = await asyncio.to_thread(pinned_model, head, pinned, machine)
    assert path == local_path(head.cache_dir, _repo(), _file_of(PINNED))
    assert path.read_bytes() == big_gguf.read_bytes()

    sliced, kind = await asyncio.to_thread(stage_source, stage, _stage(pinned, 2, 2, True), machine)
    assert kind == "hub" and inspect(sliced).tensors == inspect(big_gguf).tensors
    assert not local_path(stage.cache_dir, _repo(), _file_of(PINNED)).exists()

    # A stage that has the pinned file seeds from it and fetches nothing.
    shutil.rmtree(sliced.parent)
    hub.clear_requests()
    _place(stage.cache_dir, PINNED, big_gguf)
    again = await asyncio.to_thread(stage_source, stage, _stage(pinned, 2, 2, True), machine)
    assert again == (local_path(stage.cache_dir, _repo(), _file_of(PINNED)), "local")
    assert hub.requests == []


async def test_the_default_model_is_pinned_to_its_wheel_and_loaded_from_it(
    cache_dir: Path, model_path: Path, machine: MachineProfile
) -> None:
    pinned = await asyncio.to_thread(pin_model, DEFAULT_MODEL.id, cache_dir)
    assert pinned is not None and pinned.kind == "pypi"
    assert pinned.size == model_path.stat().st_size
    offline = WorkerSettings(router_url="127.0.0.1:9", cache_dir=cache_dir, offline=True)
    assert await asyncio.to_thread(pinned_model, offline, pinned, machine) == model_path


async def test_a_server_that_ignores_range_is_not_downloaded_whole(
    big_gguf: Path, machine: MachineProfile, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = (_repo(), _file_of(PINNED))
    with FakeHub.start({key: big_gguf}, no_ranges=[key]) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        spec = _stage(_pin(big_gguf), 1, 1, False)
        with pytest.raises(HubError, match="ignored the byte range"):
            await asyncio.to_thread(stage_source, _settings(tmp_path / "stage"), spec, machine)
        [get] = hub.downloads(*key)  # one request, dropped before its body was read
    assert not list((tmp_path / "stage").rglob("*.gguf"))
    assert get.range is not None
