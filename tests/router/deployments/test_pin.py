"""The router pins the exact file a split model's shards use (``pin.model_file``, pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.hardware.profile import MachineProfile
from shoal.models.catalog_file import load_catalog
from shoal.models.default import DEFAULT_MODEL
from shoal.models.hub_cache import Stamp
from shoal.models.resolve import FitContext, LocalModel, decide
from shoal.router.deployments.pin import model_file
from shoal.worker import hardware

BIG = "llama-3.3-70b-instruct"
COMMIT = "c0ffee" * 6 + "abcd"


@pytest.fixture(scope="module")
def machine() -> MachineProfile:
    return hardware.detect_profile()


def _hub_local(machine: MachineProfile, tmp_path: Path, quantization: str) -> LocalModel:
    entry = load_catalog().get(BIG)
    assert entry is not None
    decision = decide(entry, tmp_path, quantization=quantization, fit=FitContext(machine))
    return LocalModel(BIG, tmp_path / "x.gguf", quantization, decision)


def _stamp(file: str, commit: str | None) -> Stamp:
    entry = load_catalog().get(BIG)
    assert entry is not None
    return Stamp(entry.hub.repo, file, "main", commit, "Q2_K", "ab" * 32, 7, 1)


@pytest.mark.parametrize(
    ("commit", "stamped", "revision", "sha256"),
    [
        (COMMIT, True, COMMIT, "ab" * 32),  # downloaded: the commit it came from
        (None, True, "main", "ab" * 32),  # adopted offline: the branch it was stamped for
        (None, False, "main", None),  # copied in by hand: the catalog's branch, no sha256
    ],
)
def test_a_catalog_model_is_pinned_to_the_routers_file(
    machine: MachineProfile,
    tmp_path: Path,
    commit: str | None,
    stamped: bool,
    revision: str,
    sha256: str | None,
) -> None:
    entry = load_catalog().get(BIG)
    assert entry is not None
    local = _hub_local(machine, tmp_path, "Q2_K")
    filename = "Llama-3.3-70B-Instruct-Q2_K.gguf"
    stamp = _stamp(filename, commit) if stamped else None
    pinned = model_file(BIG, entry, local, stamp, 1234)
    assert pinned is not None
    assert (pinned.kind, pinned.repo, pinned.filename, pinned.quantization) == (
        "hub",
        entry.hub.repo,
        filename,
        "Q2_K",
    )
    assert (pinned.revision, pinned.sha256, pinned.size) == (revision, sha256, 1234)


def test_a_stamp_of_another_file_is_not_trusted(machine: MachineProfile, tmp_path: Path) -> None:
    entry = load_catalog().get(BIG)
    assert entry is not None
    stamp = _stamp("Llama-3.3-70B-Instruct-IQ3_M.gguf", COMMIT)
    pinned = model_file(BIG, entry, _hub_local(machine, tmp_path, "Q2_K"), stamp, 1)
    assert pinned is not None and (pinned.revision, pinned.sha256) == ("main", None)


def test_the_default_model_is_pinned_to_its_wheel(tmp_path: Path) -> None:
    entry = load_catalog().get(DEFAULT_MODEL.id)
    assert entry is not None and entry.pypi is not None
    local = LocalModel(entry.id, tmp_path / entry.pypi.filename, "Q4_1")
    pinned = model_file(entry.id, entry, local, None, 98)
    assert pinned is not None
    assert (pinned.kind, pinned.quantization, pinned.filename) == (
        "pypi",
        "Q4_1",
        entry.pypi.filename,
    )
    assert pinned.sha256 is not None and pinned.size == 98


@pytest.mark.parametrize("source", ["/models/x.gguf", "store-model"])
def test_a_path_or_a_store_model_is_not_pinned(source: str, tmp_path: Path) -> None:
    local = LocalModel("x", tmp_path / "x.gguf")
    assert model_file(source, None, local, None, 1) is None
