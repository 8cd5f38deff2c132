"""Model files from the Hugging Face Hub (or a mirror at ``HF_ENDPOINT``): verified, resumable.

Everything goes through ``huggingface_hub``'s HTTP layer (its session, headers, redirect rules
and error types): ``get_hf_file_metadata`` for the ``HEAD .../resolve/...`` call that gives the
commit, size and LFS sha256, ``HfApi`` for search and repo listings. The bytes themselves are
fetched here rather than with ``hf_hub_download``: in huggingface_hub 2.4 that writes to a
temporary file named per call and deletes it when the transfer fails, so an interrupted
download starts from zero next time. Here the partial file stays (``hub_cache.partial_path``)
and the next attempt asks for the rest with a ``Range`` header. Files are plain files in
``models/hub/<org>--<name>/`` (see ``hub_cache``), never Xet: the resolve URL redirects to a
plain HTTP download, so neither ``hf_xet`` nor ``hf_transfer`` is needed.

Settings come from one frozen ``HubConfig`` (``HubConfig.from_env`` is the one place the
environment is read); endpoint and token are passed explicitly on every call, so nothing
depends on what ``huggingface_hub.constants`` read at import time.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx2
from huggingface_hub import (
    HfApi,
    get_hf_file_metadata,
    get_session,
    hf_hub_url,
)
from huggingface_hub.hf_api import ExpandModelProperty_T
from huggingface_hub.hf_api import RepoFile as HfRepoFile
from huggingface_hub.utils._headers import build_hf_headers

from shoal.models import hub_cache
from shoal.models.catalog import HubSource, QuantFile
from shoal.models.errors import HubError
from shoal.models.gguf_names import RepoFile, group_quants, split_parts
from shoal.models.hub_cache import CacheState, Stamp
from shoal.models.hub_errors import HUB_FAILURES, hub_error
from shoal.models.hub_transfer import Transfer, fetch
from shoal.pip_download import file_sha256
from shoal.progress import step

logger = logging.getLogger(__name__)

# huggingface_hub gives its loggers a stderr handler of their own when it is imported; Shoal's
# processes log through the root logger (``cli.logs``), so with it every line printed twice.
for _handler in list(logging.getLogger("huggingface_hub").handlers):
    logging.getLogger("huggingface_hub").removeHandler(_handler)

DEFAULT_ENDPOINT = "https://huggingface.co"
OFFLINE_ENV = "offline mode is on (HF_HUB_OFFLINE)"
"""Why nothing is fetched, by default: what ``HubConfig.offline_reason`` says in errors."""
DOWNLOAD_ATTEMPTS = 5
"""Tries per file in one call; a transfer that broke off after some bytes retries at once."""
METADATA_TIMEOUT_S = 15.0
REACH_TIMEOUT_S = 10.0
"""For the one request that checks the Hub answers at all before a listing or search, which
huggingface_hub would otherwise retry five times with backoff (about 25 s) when it does not."""
_TRUE = frozenset({"1", "ON", "YES", "TRUE"})
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_EXPAND: list[ExpandModelProperty_T] = ["downloads", "likes", "lastModified", "gated"]


@dataclass(frozen=True)
class HubConfig:
    """Where the Hub is, how to authenticate, and whether to use it at all."""

    endpoint: str | None = None
    """Base URL of the Hub or a mirror; None is https://huggingface.co."""
    token: str | None = field(default=None, repr=False)
    offline: bool = False
    """Use only files already in the cache; never make a request."""
    offline_reason: str = OFFLINE_ENV
    """Why, for the errors that say a file is missing: the variable, a flag, or a command
    that only reads the cache."""

    def without_downloads(self, reason: str) -> HubConfig:
        """This config, offline for ``reason`` (unless it is offline already)."""
        if self.offline:
            return self
        return HubConfig(self.endpoint, self.token, offline=True, offline_reason=reason)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> HubConfig:
        """From ``HF_ENDPOINT``, ``HF_TOKEN`` (else the token `hf auth login` saved) and
        ``HF_HUB_OFFLINE``, read from ``environ`` (the CLI passes ``os.environ``)."""
        endpoint = environ.get("HF_ENDPOINT", "").strip().rstrip("/") or None
        token = environ.get("HF_TOKEN") or environ.get("HUGGING_FACE_HUB_TOKEN")
        offline = environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE
        return cls(endpoint=endpoint, token=token or _saved_token(environ), offline=offline)

    @property
    def url(self) -> str:
        return (self.endpoint or DEFAULT_ENDPOINT).rstrip("/")

    @property
    def auth(self) -> str | bool:
        """The ``token=`` argument for huggingface_hub: False means send none (never a guess)."""
        return self.token or False


def _saved_token(environ: Mapping[str, str]) -> str | None:
    if "HF_TOKEN_PATH" in environ:
        path = Path(environ["HF_TOKEN_PATH"]).expanduser()
    else:
        cache = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        path = Path(environ.get("HF_HOME") or cache / "huggingface").expanduser() / "token"
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


@dataclass(frozen=True)
class HubModel:
    """A GGUF repo found by :func:`search_hub`."""

    id: str
    downloads: int
    likes: int
    last_modified: datetime | None
    gated: bool


@dataclass(frozen=True)
class _Wanted:
    """One file to have in the cache."""

    repo: str
    file: str
    revision: str
    quantization: str
    sha256: str | None


@dataclass(frozen=True)
class _Remote:
    """What the ``HEAD`` call said about a file."""

    commit: str
    etag: str
    size: int | None
    sha256: str | None
    url: str
    """Resolve URL pinned to ``commit``, so every part comes from the same commit."""


def download(
    source: HubSource,
    quant: QuantFile,
    cache_dir: Path,
    config: HubConfig,
    *,
    attempts: int = DOWNLOAD_ATTEMPTS,
) -> Path:
    """The verified local copy of ``quant``'s files from ``source.repo``; the first file's path.

    Every part of a split GGUF is fetched (all into one folder, under their own names). A
    file with a current stamp is used without any request. An interrupted transfer is
    resumed by the next call. Raises :class:`HubError` with what to do next.
    """
    wanted = _wanted_files(source, quant)
    commit: str | None = None
    local: list[Path] = []
    for item in wanted:
        path, commit = _ensure(item, commit, cache_dir, config, attempts)
        local.append(path)
    return local[0]


def _wanted_files(source: HubSource, quant: QuantFile) -> list[_Wanted]:
    if not quant.files:
        raise HubError(f"{source.repo} {quant.quantization}: the catalog lists no files.")
    hashes = dict(zip(quant.files, quant.sha256, strict=False))
    names = dict.fromkeys(part for name in quant.files for part in split_parts(name))
    return [
        _Wanted(source.repo, name, source.revision, quant.quantization, hashes.get(name))
        for name in names
    ]


def _ensure(
    item: _Wanted, commit: str | None, cache_dir: Path, config: HubConfig, attempts: int
) -> tuple[Path, str | None]:
    target = hub_cache.local_path(cache_dir, item.repo, item.file)
    state = hub_cache.cache_state(target, item.sha256, item.revision)
    if state is CacheState.VERIFIED:
        stamp = hub_cache.read_stamp(target)
        return target, commit or (stamp.commit if stamp is not None else None)
    if config.offline:
        return _offline_file(item, target, state, config), commit
    remote = _remote_file(item, commit or item.revision, config)
    if state is CacheState.UNVERIFIED and _adopt_existing(item, target, remote):
        return target, remote.commit
    with hub_cache.download_lock(hub_cache.lock_path(cache_dir, item.repo, item.file)):
        if hub_cache.cache_state(target, remote.sha256, item.revision) is CacheState.VERIFIED:
            return target, remote.commit  # another process finished it while we waited
        _fetch(item, remote, target, config, attempts)
    return target, remote.commit


def _offline_file(item: _Wanted, target: Path, state: CacheState, config: HubConfig) -> Path:
    if state is CacheState.MISSING:
        raise HubError(
            f"{item.file} of {item.repo} is not in the cache, and {config.offline_reason}. "
            f"Copy the file to {target}, or run `shoal models pull` for this model while online."
        )
    if item.sha256 is None:
        logger.warning("offline: using %s unverified (no sha256 known without the Hub)", target)
        return target
    step(f"Verifying {target}")
    actual = file_sha256(target)
    if actual != item.sha256:
        raise HubError(
            f"{target} has sha256 {actual}, but {item.file} of {item.repo} should have "
            f"{item.sha256}. Delete it and copy the right file there, or run `shoal models "
            "pull` while online."
        )
    _stamp(item, target, None, actual)
    return target


def _remote_file(item: _Wanted, revision: str, config: HubConfig) -> _Remote:
    url = hf_hub_url(item.repo, item.file, revision=revision, endpoint=config.url)
    try:
        meta = get_hf_file_metadata(
            url, token=config.auth, timeout=METADATA_TIMEOUT_S, endpoint=config.url
        )
    except HUB_FAILURES as exc:
        raise hub_error(exc, config, item.repo, item.file, revision) from exc
    if meta.commit_hash is None or meta.etag is None:
        raise HubError(
            f"{config.url} answered for {item.file} of {item.repo} without the X-Repo-Commit "
            "or ETag headers of a Hugging Face Hub; check HF_ENDPOINT."
        )
    hub_sha = meta.etag if _SHA256_RE.fullmatch(meta.etag) else None
    if item.sha256 is not None and hub_sha is not None and hub_sha != item.sha256:
        raise HubError(
            f"{item.file} in {item.repo} at commit {meta.commit_hash} has sha256 {hub_sha}, but "
            f"the catalog expects {item.sha256}: the repo changed since the catalog was made. "
            "Nothing was downloaded; update Shoal or pick another quantization."
        )
    return _Remote(
        commit=meta.commit_hash,
        etag=meta.etag,
        size=meta.size,
        sha256=item.sha256 or hub_sha,
        url=hf_hub_url(item.repo, item.file, revision=meta.commit_hash, endpoint=config.url),
    )


def _adopt_existing(item: _Wanted, target: Path, remote: _Remote) -> bool:
    """Whether a file already at ``target`` (pre-staged, or stamped for another revision)
    matches the Hub's; if so it is stamped and kept, else the download replaces it."""
    if remote.size is not None and target.stat().st_size != remote.size:
        return False
    step(f"Verifying {target}")
    actual = file_sha256(target)
    if remote.sha256 is not None and actual != remote.sha256:
        logger.warning("%s does not match the Hub's %s; downloading it again", target, item.file)
        return False
    _stamp(item, target, remote.commit, actual)
    return True


def _fetch(item: _Wanted, remote: _Remote, target: Path, config: HubConfig, attempts: int) -> None:
    headers = build_hf_headers(token=config.auth)
    headers["Accept-Encoding"] = "identity"  # sizes and Range offsets count file bytes
    transfer = Transfer(
        url=remote.url,
        headers=headers,
        partial=hub_cache.partial_path(target, remote.etag),
        size=remote.size,
        sha256=remote.sha256,
        name=target.name,
        label=f"{item.file} of repo {item.repo}",
        source=config.url,
    )
    try:
        sha256 = fetch(transfer, attempts)
    except HUB_FAILURES as exc:
        raise hub_error(exc, config, item.repo, item.file, remote.commit) from exc
    os.replace(transfer.partial, target)
    _stamp(item, target, remote.commit, sha256)
    logger.info("downloaded %s of %s (%s) to %s", item.file, item.repo, remote.commit, target)


def _stamp(item: _Wanted, target: Path, commit: str | None, sha256: str) -> None:
    stat = target.stat()
    stamp = Stamp(
        repo=item.repo,
        file=item.file,
        revision=item.revision,
        commit=commit,
        quantization=item.quantization,
        sha256=sha256,
        size=stat.st_size,
        mtime_ns=stat.st_mtime_ns,
    )
    hub_cache.write_stamp(target, stamp)


def locate(
    repo: str, filename: str, revision: str, config: HubConfig, sha256: str | None = None
) -> tuple[str, str, int | None]:
    """The resolve URL of ``filename`` pinned to its commit, the commit, and the file's size:
    one ``HEAD`` request (``sha256``, when known, must match the Hub's). Raises ``HubError``."""
    if config.offline:
        raise HubError(
            f"{filename} of {repo} is not on this machine, and fetching any of it needs the "
            f"Hugging Face Hub, and {config.offline_reason}."
        )
    remote = _remote_file(_Wanted(repo, filename, revision, "", sha256), revision, config)
    return remote.url, remote.commit, remote.size


def _check_reachable(config: HubConfig, repo: str | None, revision: str | None) -> None:
    """Fail at once, in one line, when the Hub does not answer at all: one request without
    retries (any HTTP answer will do) before a listing huggingface_hub would retry."""
    try:
        get_session().head(config.url, timeout=REACH_TIMEOUT_S)
    except httpx2.TransportError as exc:
        raise hub_error(exc, config, repo, None, revision) from exc


SEARCH_SCAN = 500
"""GGUF repos (most downloaded first) read for a search of several words, among which those
whose id holds every word are kept: the Hub matches one string within ids, not words."""


def search_hub(query: str, config: HubConfig, limit: int = 20) -> list[HubModel]:
    """GGUF repos on the Hub whose id contains every word of ``query`` (any case), most
    downloaded first. The Hub is asked for the longest word; the others are matched here,
    among its ``SEARCH_SCAN`` most downloaded answers ("qwen 7b" found nothing when the Hub
    was asked for the ids containing "qwen 7b")."""
    words = query.lower().split()
    if config.offline:
        raise HubError(
            f"searching the Hugging Face Hub needs the network, and {config.offline_reason}. "
            "`shoal models ls` lists the models already downloaded."
        )
    _check_reachable(config, None, None)
    api = HfApi(endpoint=config.url, token=config.auth)
    longest = max(words, key=len) if words else None
    scan = SEARCH_SCAN if len(words) > 1 else limit
    try:
        infos = list(
            api.list_models(
                filter="gguf", search=longest, sort="downloads", limit=scan, expand=_EXPAND
            )
        )
    except HUB_FAILURES as exc:
        raise hub_error(exc, config, None, None, None) from exc
    found = [info for info in infos if all(w in info.id.lower() for w in words)]
    return [
        HubModel(
            id=info.id,
            downloads=info.downloads or 0,
            likes=info.likes or 0,
            last_modified=info.last_modified,
            gated=bool(info.gated),
        )
        for info in found[:limit]
    ]


def repo_source(repo: str, config: HubConfig, revision: str = "main") -> HubSource:
    """The GGUF quantizations in any Hub repo (sizes and LFS sha256 from its file tree)."""
    offline = "Use a model from the catalog or the path of a .gguf file."
    files = list_repo_files(repo, config, revision, offline_hint=offline)
    quants = group_quants(files)
    if not quants:
        raise HubError(f"{repo} (revision {revision}) has no .gguf files; pick a GGUF repo.")
    return HubSource(repo=repo, quants=quants, revision=revision)


def list_repo_files(
    repo: str,
    config: HubConfig,
    revision: str = "main",
    *,
    offline_hint: str = "Use a local path, or pull the model while online.",
) -> list[RepoFile]:
    """Every file of a Hub repo (path, size, LFS sha256), from its tree listing; offline, a
    ``HubError`` that ends with ``offline_hint`` (what to do instead)."""
    if config.offline:
        raise HubError(
            f"listing the files of {repo} needs the Hugging Face Hub, and "
            f"{config.offline_reason}. {offline_hint}"
        )
    hub_cache.check_repo_id(repo)
    _check_reachable(config, repo, revision)
    api = HfApi(endpoint=config.url, token=config.auth)
    try:
        tree = list(api.list_repo_tree(repo, revision=revision, recursive=True))
    except HUB_FAILURES as exc:
        raise hub_error(exc, config, repo, None, revision) from exc
    return [
        RepoFile(entry.path, entry.size, entry.lfs.sha256 if entry.lfs is not None else None)
        for entry in tree
        if isinstance(entry, HfRepoFile)
    ]


def download_repo_files(
    repo: str, files: list[RepoFile], cache_dir: Path, config: HubConfig, revision: str = "main"
) -> Path:
    """``files`` of ``repo`` in the cache, verified and resumable like GGUF files, all from one
    commit; the repo's cache folder (where they keep their paths inside the repo)."""
    commit: str | None = None
    for file in files:
        wanted = _Wanted(repo, file.path, revision, "", file.sha256)
        _, commit = _ensure(wanted, commit, cache_dir, config, DOWNLOAD_ATTEMPTS)
    return hub_cache.repo_dir(cache_dir, repo)
