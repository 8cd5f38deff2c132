"""Data for the FAKE Hugging Face Hub (fake_hub.py): its files and the API's JSON about them.

The JSON shapes imitate huggingface.co's ``/api/models`` endpoints as huggingface_hub 2.4
parses them (``ModelInfo``, ``RepoFile``, ``RepoFolder``, ``RepoSibling``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FileKey = tuple[str, str]
"""(repo id, path inside the repo)."""

DEFAULT_DATE = "2024-06-01T12:00:00.000Z"


@dataclass(frozen=True)
class FakeFile:
    """One file of a repo: its bytes (in memory or on disk) and the hashes the Hub reports."""

    repo: str
    path: str
    size: int
    sha256: str
    git_oid: str
    data: bytes | None = None
    source: Path | None = None

    @classmethod
    def of(cls, repo: str, path: str, content: bytes | Path) -> FakeFile:
        if isinstance(content, bytes):
            sha, size = hashlib.sha256(content).hexdigest(), len(content)
            return cls(repo, path, size, sha, git_oid(sha), data=content)
        digest = hashlib.sha256()
        with content.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        sha = digest.hexdigest()
        return cls(repo, path, content.stat().st_size, sha, git_oid(sha), source=content)

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` (exclusive)."""
        if self.data is not None:
            return self.data[start:end]
        assert self.source is not None
        with self.source.open("rb") as f:
            f.seek(start)
            return f.read(end - start)


def git_oid(text: str) -> str:
    """A stand-in git blob id (the fake has no git objects)."""
    return hashlib.sha1(text.encode()).hexdigest()


@dataclass(frozen=True)
class RepoInfo:
    """What the search API reports about a repo."""

    downloads: int = 0
    likes: int = 0
    last_modified: str = DEFAULT_DATE
    tags: tuple[str, ...] = ("gguf",)


def search_results(
    repos: Mapping[str, RepoInfo], params: Mapping[str, list[str]]
) -> list[tuple[str, list[str] | None]]:
    """The repos ``GET /api/models`` lists for these query parameters, with ``expand``."""
    search = params.get("search", [""])[0].lower()
    tags = set(params.get("filter", []))
    found = [
        (repo, info)
        for repo, info in repos.items()
        if search in repo.lower() and tags <= set(info.tags)
    ]
    sort = params.get("sort", [""])[0]
    if sort in ("downloads", "likes", "lastModified"):
        attribute = {"lastModified": "last_modified"}.get(sort, sort)
        found.sort(key=lambda item: getattr(item[1], attribute), reverse=True)
    limit = int(params.get("limit", ["1000"])[0])
    expand = params.get("expand[]", params.get("expand"))
    return [(repo, expand) for repo, _ in found[:limit]]


def model_json(
    repo: str, info: RepoInfo, commit: str, gated: bool, expand: list[str] | None
) -> dict[str, Any]:
    """A model as the Hub's API describes it; only ``expand``'s fields when given."""
    full: dict[str, Any] = {
        "_id": hashlib.sha1(repo.encode()).hexdigest()[:24],
        "id": repo,
        "modelId": repo,
        "sha": commit,
        "downloads": info.downloads,
        "likes": info.likes,
        "lastModified": info.last_modified,
        "createdAt": DEFAULT_DATE,
        "private": False,
        "gated": "manual" if gated else False,
        "disabled": False,
        "tags": list(info.tags),
        "library_name": "gguf",
    }
    if expand is None:
        return full
    return {k: v for k, v in full.items() if k in ("_id", "id", *expand)}


def tree_entries(files: Iterable[FakeFile], under: str, recursive: bool) -> list[dict[str, Any]]:
    """``GET /api/models/{repo}/tree/{rev}/{under}``: files (with LFS info) and folders."""
    prefix = f"{under.strip('/')}/" if under else ""
    entries: dict[str, dict[str, Any]] = {}
    for f in files:
        if not f.path.startswith(prefix):
            continue
        rest = f.path[len(prefix) :].split("/")
        folders = range(1, len(rest)) if recursive else range(1, min(2, len(rest)))
        for i in folders:
            folder = prefix + "/".join(rest[:i])
            entries[folder] = {"type": "directory", "oid": git_oid(folder), "path": folder}
        if recursive or len(rest) == 1:
            entries[f.path] = {
                "type": "file",
                "oid": f.git_oid,
                "size": f.size,
                "path": f.path,
                "lfs": {"oid": f.sha256, "size": f.size, "pointerSize": 134},
            }
    return [entries[k] for k in sorted(entries)]


def sibling(f: FakeFile, blobs: bool) -> dict[str, Any]:
    """A file in ``siblings`` of ``GET /api/models/{repo}`` (sizes with ``blobs=true``)."""
    if not blobs:
        return {"rfilename": f.path}
    lfs = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
    return {"rfilename": f.path, "size": f.size, "blobId": f.git_oid, "lfs": lfs}


def by_path(f: FakeFile) -> str:
    return f.path
