"""``--model org/repo[:QUANT]``: any GGUF repo resolved against the FAKE hub (tests/fakes/
fake_hub.py, Hugging Face's protocol on loopback): listed, chosen by name or by fit, split
parts downloaded together, gated, offline, and kept apart from other repos in the cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fakes.fake_hub import FakeHub
from shaped_gguf import KV_BYTES_PER_TOKEN, shaped_gguf
from shoal.hardware.profile import Accelerator, CpuInfo, GpuDevice, MachineProfile
from shoal.models.errors import HubError, ModelError
from shoal.models.fit import NoQuantizationFits
from shoal.models.hub import HubConfig
from shoal.models.hub_cache import local_path
from shoal.models.resolve import FitContext, resolve_model
from shoal.units import GIB, MIB

REPO = "someone/Model-7B-GGUF"
Q4 = "Model-7B-Q4_K_M.gguf"
Q8_PARTS = [f"Q8_0/Model-7B-Q8_0-0000{i}-of-00002.gguf" for i in (1, 2)]
TOKEN = "hf_secret"
CTX = 1024
"""At 128 KiB a token (``shaped_gguf``), a 128 MiB KV cache."""


Q4_DATA = shaped_gguf(2 * MIB)
Q8_DATA = [shaped_gguf(20 * MIB, split=(0, 2)), b"GGUF" + bytes(20 * MIB)]
FILES: dict[tuple[str, str], bytes | Path] = {
    (REPO, Q4): Q4_DATA,
    **{(REPO, p): d for p, d in zip(Q8_PARTS, Q8_DATA, strict=True)},
    (REPO, "README.md"): b"# Model\n",
    (REPO, "mmproj-Model-F16.gguf"): shaped_gguf(10),
    ("other/Model-7B-GGUF", Q4): shaped_gguf(3 * MIB),
    ("someone/safetensors-only", "config.json"): b"{}",
    ("someone/safetensors-only", "model.safetensors"): b"\0" * 16,
}


def gpu_with(free: int) -> FitContext:
    """A machine whose one GPU has ``free`` bytes free, at ``CTX`` tokens of context."""
    cpu = CpuInfo(model="Test CPU", logical_cores=8, arch="x86_64")
    gpu = GpuDevice(0, "NVIDIA", Accelerator.CUDA, 80 * GIB, free)
    return FitContext(MachineProfile("h", "linux", cpu, 64 * GIB, 32 * GIB, (gpu,)), ctx_total=CTX)


# need = (weights + 128 MiB KV) x 1.1 + 64 MiB: Q4 (2 MiB) 207 MiB; Q8 (40 MiB) 249 MiB.
ROOM_FOR_Q4 = gpu_with(230 * MIB)
ROOM_FOR_Q8 = gpu_with(300 * MIB)


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with FakeHub.start(FILES) as fake:
        yield fake


@pytest.fixture
def config(hub: FakeHub) -> HubConfig:
    return HubConfig(endpoint=hub.url)


def fetched(hub: FakeHub) -> set[str]:
    """The files whose bytes were downloaded whole (a header read is a Range request)."""
    return {
        r.query for r in hub.requests if r.server == "cdn" and r.method == "GET" and not r.range
    }


def test_a_named_quantization_downloads_its_split_parts_together(
    hub: FakeHub, config: HubConfig, tmp_path: Path
) -> None:
    local = resolve_model(f"{REPO}:q8_0", tmp_path, fit=ROOM_FOR_Q8, hub=config)

    assert local.id == f"{REPO}:q8_0" and local.quantization == "Q8_0"
    assert local.path == local_path(tmp_path, REPO, Q8_PARTS[0])  # llama-server gets the first
    for part, data in zip(Q8_PARTS, Q8_DATA, strict=True):
        assert local_path(tmp_path, REPO, part).read_bytes() == data
        assert len(hub.downloads(REPO, part)) == 1
    assert hub.downloads(REPO, Q4) == []
    assert local.decision is not None and local.decision.requested and local.decision.fits


def test_without_a_quantization_the_fit_chooses_with_the_kv_cache_read_from_the_header(
    hub: FakeHub, config: HubConfig, tmp_path: Path
) -> None:
    """The weights alone fit both (Q8: 40 MiB x 1.1 + 64 MiB = 108 MiB of 230): only the KV
    cache the header's shape gives (128 MiB) rules Q8 out."""
    small = resolve_model(REPO, tmp_path / "a", fit=ROOM_FOR_Q4, hub=config)
    assert small.quantization == "Q4_K_M" and small.id == REPO
    assert small.path.read_bytes() == Q4_DATA
    assert (
        small.decision is not None
        and small.decision.need.kv_bytes == KV_BYTES_PER_TOKEN * CTX == 128 * MIB
    )
    assert "Q8_0 would need" in small.decision.reason
    header_reads = [r for r in hub.requests if r.server == "cdn" and r.range is not None]
    assert header_reads and all("Q4_K_M" in r.query for r in header_reads)  # the smallest
    assert hub.sent(REPO, Q4) < 2 * len(Q4_DATA)  # its header, then the file once

    hub.clear_requests()
    big = resolve_model(f"hf.co/{REPO}", tmp_path / "b", fit=ROOM_FOR_Q8, hub=config)
    assert big.quantization == "Q8_0" and big.path.name == Path(Q8_PARTS[0]).name
    assert len(fetched(hub)) == 2


def test_a_model_too_big_for_the_machine_is_refused_before_downloading(
    hub: FakeHub, config: HubConfig, tmp_path: Path
) -> None:
    with pytest.raises(NoQuantizationFits, match=f"{REPO} does not fit"):
        resolve_model(REPO, tmp_path, fit=gpu_with(150 * MIB), hub=config)
    assert fetched(hub) == set()


def test_a_named_file(hub: FakeHub, config: HubConfig, tmp_path: Path) -> None:
    local = resolve_model(f"hf.co/{REPO}:{Q4}", tmp_path, fit=ROOM_FOR_Q4, hub=config)
    assert local.id == f"{REPO}:{Q4}" and local.quantization == "Q4_K_M"
    assert local.path.read_bytes() == Q4_DATA


def test_names_that_miss_say_what_there_is(hub: FakeHub, config: HubConfig, tmp_path: Path) -> None:
    with pytest.raises(
        ModelError, match=rf"{REPO} has no Q5_K_M quantization; it has Q4_K_M, Q8_0"
    ):
        resolve_model(f"{REPO}:Q5_K_M", tmp_path, fit=ROOM_FOR_Q8, hub=config)
    with pytest.raises(HubError, match=r"repo someone/Nope was not found .*HTTP 401"):
        resolve_model("someone/Nope:Q4_K_M", tmp_path, fit=ROOM_FOR_Q8, hub=config)
    with pytest.raises(
        HubError, match=r"has no GGUF model \(it holds config.json, model.safetensors\)"
    ):
        resolve_model("someone/safetensors-only", tmp_path, fit=ROOM_FOR_Q8, hub=config)
    assert fetched(hub) == set()


def test_a_gated_repo_needs_the_token(tmp_path: Path) -> None:
    with FakeHub.start(FILES, gated={REPO: TOKEN}) as hub:
        with pytest.raises(HubError, match="no token was sent"):
            resolve_model(
                f"{REPO}:Q4_K_M", tmp_path, fit=ROOM_FOR_Q4, hub=HubConfig(endpoint=hub.url)
            )
        config = HubConfig(endpoint=hub.url, token=TOKEN)
        local = resolve_model(f"{REPO}:Q4_K_M", tmp_path, fit=ROOM_FOR_Q4, hub=config)
    assert local.path.read_bytes() == Q4_DATA


def test_offline_a_cached_repo_resolves_without_a_request(
    hub: FakeHub, config: HubConfig, tmp_path: Path
) -> None:
    offline = config.without_downloads("offline mode is on (--offline)")
    with pytest.raises(HubError, match=rf"{REPO} is not in the cache .*--offline.*models pull"):
        resolve_model(REPO, tmp_path, fit=ROOM_FOR_Q8, hub=offline)
    pulled = resolve_model(f"{REPO}:Q4_K_M", tmp_path, fit=ROOM_FOR_Q8, hub=config)
    hub.clear_requests()

    # Only what is cached counts: the fit takes Q4 although Q8 would fit.
    again = resolve_model(REPO, tmp_path, fit=ROOM_FOR_Q8, hub=offline)
    named = resolve_model(f"{REPO}:q4_k_m", tmp_path, download=False, hub=config)
    assert again.path == named.path == pulled.path and again.quantization == "Q4_K_M"
    with pytest.raises(ModelError, match=r"no Q8_0 quantization; it has Q4_K_M"):
        resolve_model(f"{REPO}:Q8_0", tmp_path, fit=ROOM_FOR_Q8, hub=offline)
    assert hub.requests == []


def test_repos_with_the_same_file_names_are_kept_apart(
    hub: FakeHub, config: HubConfig, tmp_path: Path
) -> None:
    mine = resolve_model(f"{REPO}:Q4_K_M", tmp_path, fit=ROOM_FOR_Q4, hub=config)
    theirs = resolve_model("other/Model-7B-GGUF:Q4_K_M", tmp_path, fit=ROOM_FOR_Q4, hub=config)
    assert mine.path != theirs.path and mine.path.name == theirs.path.name
    assert mine.path.read_bytes() == Q4_DATA
    assert theirs.path.read_bytes() == FILES[("other/Model-7B-GGUF", Q4)]


def test_a_path_on_disk_wins_over_a_repo_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``org/repo:file.gguf`` that exists here is that file (nothing is asked of the Hub)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "repo:x.gguf").write_bytes(Q4_DATA)
    local = resolve_model("org/repo:x.gguf", tmp_path, hub=HubConfig(endpoint="http://127.0.0.1:9"))
    assert local.id == "repo:x" and local.path == tmp_path / "org" / "repo:x.gguf"
