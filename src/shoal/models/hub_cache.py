"""Where Hugging Face downloads live in Shoal's cache, their stamps, and listing/removing them.

Layout: ``models/hub/<org>--<name>/<path in repo>``, the repo's files under their original names
(so the parts of a split GGUF sit side by side, as llama.cpp needs). Beside each file:

- ``<file>.verified.json``: the stamp, written once the file's size and sha256 were checked;
  it also records the repo, revision, commit and quantization (for ``shoal models ls``);
- ``<file>.<etag>.incomplete``: a download in progress, resumed by the next attempt;

and ``models/hub/.locks/<org>--<name>/<file>.lock``, held while one process downloads the file
(kept apart so a failed download leaves nothing in the repo's folder).

A file copied in by hand (pre-staged for offline use) is a plain file without a stamp.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from shoal import paths
from shoal.models.errors import HubError
from shoal.models.gguf_names import guess_quantization, split_name, split_parts

logger = logging.getLogger(__name__)

HUB_FOLDER = "hub"
REPO_SEPARATOR = "--"
"""Replaces ``/`` in a repo id to make its folder name (the Hub forbids ``--`` in ids)."""
STAMP_SUFFIX = ".verified.json"
PARTIAL_SUFFIX = ".incomplete"
LOCK_SUFFIX = ".lock"
LOCKS_FOLDER = ".locks"
_ETAG_IN_NAME = 16
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def hub_dir(cache_dir: Path) -> Path:
    """The folder holding every downloaded Hub repo."""
    return paths.models_dir(cache_dir) / HUB_FOLDER


def check_repo_id(repo: str) -> None:
    """Raise :class:`HubError` unless ``repo`` looks like a Hub repo id (``org/name``)."""
    if _REPO_RE.match(repo) is None or REPO_SEPARATOR in repo or ".." in repo:
        raise HubError(f"{repo!r} is not a Hugging Face repo id; expected `org/name`.")


def repo_dir(cache_dir: Path, repo: str) -> Path:
    """The folder of one repo's downloaded files."""
    check_repo_id(repo)
    return hub_dir(cache_dir) / repo.replace("/", REPO_SEPARATOR)


def local_path(cache_dir: Path, repo: str, filename: str) -> Path:
    """Where ``filename`` (a path inside ``repo``) is kept in the cache."""
    parts = PurePosixPath(filename).parts
    if not parts or filename.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise HubError(f"{filename!r} is not a file path inside repo {repo}.")
    return repo_dir(cache_dir, repo).joinpath(*parts)


def partial_path(target: Path, etag: str) -> Path:
    """The unfinished download of ``target``; the etag in the name keeps versions apart."""
    tag = re.sub(r"[^0-9A-Za-z]", "", etag)[:_ETAG_IN_NAME] or "0"
    return target.with_name(f"{target.name}.{tag}{PARTIAL_SUFFIX}")


def stamp_path(target: Path) -> Path:
    return target.with_name(target.name + STAMP_SUFFIX)


def lock_path(cache_dir: Path, repo: str, filename: str) -> Path:
    """The lock file guarding the download of ``filename`` of ``repo``."""
    relative = local_path(cache_dir, repo, filename).relative_to(hub_dir(cache_dir))
    return hub_dir(cache_dir) / LOCKS_FOLDER / relative.with_name(relative.name + LOCK_SUFFIX)


@contextlib.contextmanager
def download_lock(lock: Path) -> Iterator[None]:
    """Held while this process downloads a file; another process waits for it."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process holds %s; waiting for it", lock)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass(frozen=True)
class Stamp:
    """What was verified about a downloaded file, and where it came from."""

    repo: str
    file: str
    revision: str
    commit: str | None
    quantization: str | None
    sha256: str
    size: int
    mtime_ns: int


class CacheState(enum.Enum):
    MISSING = "missing"
    VERIFIED = "verified"
    """A current stamp says the file was checked (and, if given, against this sha256)."""
    UNVERIFIED = "unverified"
    """The file is there but was never checked, changed since, or checked for another version."""


def read_stamp(target: Path) -> Stamp | None:
    try:
        data = json.loads(stamp_path(target).read_text(encoding="utf-8"))
        return Stamp(**data)
    except (FileNotFoundError, ValueError, TypeError):
        return None


def write_stamp(target: Path, stamp: Stamp) -> None:
    path = stamp_path(target)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(stamp)) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def cache_state(target: Path, sha256: str | None, revision: str) -> CacheState:
    """Whether ``target`` can be used without reading it: a ``stat`` and a small read."""
    try:
        stat = target.stat()
    except FileNotFoundError:
        return CacheState.MISSING
    stamp = read_stamp(target)
    current = (
        stamp is not None
        and (stamp.size, stamp.mtime_ns) == (stat.st_size, stat.st_mtime_ns)
        and (sha256 is None or stamp.sha256 == sha256)
        and revision in (stamp.revision, stamp.commit)
    )
    return CacheState.VERIFIED if current else CacheState.UNVERIFIED


@dataclass(frozen=True)
class CachedModel:
    """One downloaded quantization of a repo (or one file whose quantization is unknown)."""

    repo: str
    quantization: str | None
    files: tuple[str, ...]
    """Paths inside the repo of the finished files, split parts in order."""
    size_bytes: int
    """Bytes of the finished files."""
    path: Path
    """The file to load: the only file, or the first part of a split GGUF."""
    complete: bool
    """False while a split part is missing or a download is unfinished."""
    partial_bytes: int = 0


def list_cached(cache_dir: Path) -> list[CachedModel]:
    """Every downloaded quantization in the cache, sorted by repo and quantization."""
    root = hub_dir(cache_dir)
    if not root.is_dir():
        return []
    found: list[CachedModel] = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name != LOCKS_FOLDER):
        found.extend(_repo_models(folder, folder.name.replace(REPO_SEPARATOR, "/")))
    return found


def remove_cached(cache_dir: Path, repo: str, quantization: str | None) -> int:
    """Delete a repo's downloaded files (one quantization, or all if None); bytes freed.

    Their stamps and unfinished downloads go too. 0 if nothing matched.
    """
    folder = repo_dir(cache_dir, repo)
    if not folder.is_dir():
        return 0
    if quantization is None:
        freed = sum(f.stat().st_size for f in _files(folder))
        shutil.rmtree(folder)
        logger.info("removed %s from the cache (%d bytes)", repo, freed)
        return freed
    wanted = quantization.upper()
    freed = 0
    for file in _files(folder):
        if _quantization_of(folder, _model_file_of(folder, file)) == wanted:
            freed += file.stat().st_size
            file.unlink()
    _prune_empty(folder)
    logger.info("removed %s %s from the cache (%d bytes)", repo, wanted, freed)
    return freed


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".tmp"))


def _model_file_of(folder: Path, file: Path) -> str:
    """The repo path of the model file that ``file`` (it, its stamp or partial) is for."""
    name = file.name
    if name.endswith(STAMP_SUFFIX):
        name = name[: -len(STAMP_SUFFIX)]
    elif name.endswith(PARTIAL_SUFFIX):
        name = name[: -len(PARTIAL_SUFFIX)].rsplit(".", 1)[0]
    return file.with_name(name).relative_to(folder).as_posix()


def _quantization_of(folder: Path, repo_path: str) -> str | None:
    stamp = read_stamp(folder / repo_path)
    if stamp is not None and stamp.quantization:
        return stamp.quantization.upper()
    return guess_quantization(repo_path)


_GroupKey = tuple[str | None, str]
"""(quantization, "") for a known quantization, else (None, the file's repo path)."""


def _repo_models(folder: Path, repo: str) -> list[CachedModel]:
    finished: dict[_GroupKey, list[Path]] = {}
    partial: dict[_GroupKey, int] = {}
    for file in _files(folder):
        if file.name.endswith(STAMP_SUFFIX):
            continue
        model_file = _model_file_of(folder, file)
        quant = _quantization_of(folder, model_file)
        key: _GroupKey = (quant, "") if quant is not None else (None, model_file)
        if file.name.endswith(PARTIAL_SUFFIX):
            partial[key] = partial.get(key, 0) + file.stat().st_size
        else:
            finished.setdefault(key, []).append(file)
    return [
        _cached_model(folder, repo, key[0], finished.get(key, []), partial.get(key, 0))
        for key in sorted(set(finished) | set(partial), key=lambda k: (k[0] or "", k[1]))
    ]


def _cached_model(
    folder: Path, repo: str, quant: str | None, files: list[Path], partial_bytes: int
) -> CachedModel:
    names = sorted((f.relative_to(folder).as_posix() for f in files), key=_part_order)
    expected = {part for name in names for part in split_parts(name)}
    return CachedModel(
        repo=repo,
        quantization=quant,
        files=tuple(names),
        size_bytes=sum(f.stat().st_size for f in files),
        path=folder / names[0] if names else folder,
        complete=bool(names) and partial_bytes == 0 and expected <= set(names),
        partial_bytes=partial_bytes,
    )


def _part_order(name: str) -> tuple[str, int]:
    split = split_name(name)
    return (name, 0) if split is None else (split.stem, split.index)


def _prune_empty(folder: Path) -> None:
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), reverse=True):
        with contextlib.suppress(OSError):
            sub.rmdir()
    with contextlib.suppress(OSError):
        folder.rmdir()
