"""Unpacking a downloaded llama.cpp release archive (zip or tar.gz) without trusting it.

Every member must land inside the target folder: absolute paths, ``..`` components, drive
letters, device files and links pointing outside are refused before anything is written.
Links that stay inside are kept, since a release's shared libraries are reached through
them (``libllama.so -> libllama.so.0``). Tar archives are additionally unpacked with
Python's ``data`` filter, which enforces the same rules a second time.
"""

from __future__ import annotations

import posixpath
import re
import shutil
import stat
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

from shoal.llama_cpp.errors import LlamaCppError

_DRIVE_RE = re.compile(r"^[A-Za-z]:")
_DEFAULT_FILE_MODE = 0o644
_MODE_MASK = 0o755
"""Permission bits kept from an archive: never setuid/setgid/sticky or group/other write."""


class UnsafeArchiveError(LlamaCppError):
    """An archive member would be written outside the target folder."""


def extract(archive: Path, dest: Path) -> None:
    """Unpack ``archive`` (``.zip``, ``.tar.gz`` or ``.tgz``) into ``dest`` (created).

    Raises:
        UnsafeArchiveError: a member would escape ``dest``; nothing is written then.
        LlamaCppError: the archive is unreadable or of an unknown kind.
    """
    dest.mkdir(parents=True, exist_ok=True)
    name = archive.name
    try:
        if name.endswith(".zip"):
            _extract_zip(archive, dest)
        elif name.endswith((".tar.gz", ".tgz")):
            _extract_tar(archive, dest)
        else:
            raise LlamaCppError(f"cannot unpack {archive}: expected a .zip or .tar.gz archive")
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as exc:
        raise LlamaCppError(f"could not unpack {archive}: {exc}. Delete it and try again.") from exc


def member_path(name: str) -> PurePosixPath | None:
    """The relative path an archive member named ``name`` may be written to.

    None for the archive's root itself (``./``). UnsafeArchiveError for an absolute path,
    a drive letter or a ``..`` component.
    """
    normalized = name.replace("\\", "/")
    if normalized.startswith("/") or _DRIVE_RE.match(normalized):
        raise UnsafeArchiveError(f"archive member {name!r} has an absolute path; refusing it")
    parts = [part for part in normalized.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchiveError(f"archive member {name!r} climbs out with '..'; refusing it")
    return PurePosixPath(*parts) if parts else None


def check_link(member: PurePosixPath, target: str) -> None:
    """UnsafeArchiveError unless a symlink at ``member`` pointing to ``target`` stays inside."""
    if target.startswith("/") or _DRIVE_RE.match(target) or not target:
        raise UnsafeArchiveError(
            f"archive link {member} points to {target!r}, outside; refusing it"
        )
    resolved = posixpath.normpath(posixpath.join(str(member.parent), target))
    if resolved == ".." or resolved.startswith("../"):
        raise UnsafeArchiveError(
            f"archive link {member} points to {target!r}, outside; refusing it"
        )


def _extract_tar(archive: Path, dest: Path) -> None:
    with tarfile.open(archive, "r:gz") as tar:
        members = tar.getmembers()
        for info in members:
            _check_tar_member(info)
        try:
            tar.extractall(dest, members=members, filter="data")
        except tarfile.FilterError as exc:
            raise UnsafeArchiveError(f"{archive.name}: {exc}; refusing it") from exc


def _check_tar_member(info: tarfile.TarInfo) -> None:
    path = member_path(info.name)
    if not (info.isfile() or info.isdir() or info.issym() or info.islnk()):
        raise UnsafeArchiveError(f"archive member {info.name!r} is a device or fifo; refusing it")
    if path is None:
        if not info.isdir():
            raise UnsafeArchiveError(f"archive member {info.name!r} has no name; refusing it")
        return
    if info.issym():
        check_link(path, info.linkname)
    elif info.islnk():
        member_path(info.linkname)  # hard links name another member, from the root


def _extract_zip(archive: Path, dest: Path) -> None:
    root = dest.resolve()
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        links: list[tuple[PurePosixPath, str]] = []
        files: list[tuple[zipfile.ZipInfo, PurePosixPath]] = []
        for info in infos:
            path = member_path(info.filename)
            if path is None:
                continue
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                target = zf.read(info).decode("utf-8")
                check_link(path, target)
                links.append((path, target))
            else:
                files.append((info, path))
        for info, path in files:
            _write_zip_member(zf, info, root, path)
        for path, target in links:  # last, so no file is ever written through a link
            link = root / path
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(target)


def _write_zip_member(
    zf: zipfile.ZipFile, info: zipfile.ZipInfo, root: Path, path: PurePosixPath
) -> None:
    target = root / path
    if not target.resolve().is_relative_to(root):
        raise UnsafeArchiveError(f"archive member {info.filename!r} escapes {root}; refusing it")
    if info.is_dir():
        target.mkdir(parents=True, exist_ok=True)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with zf.open(info) as source, target.open("wb") as sink:
        shutil.copyfileobj(source, sink)
    mode = (info.external_attr >> 16) & _MODE_MASK
    target.chmod(mode or _DEFAULT_FILE_MODE)
