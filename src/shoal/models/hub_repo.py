"""Any GGUF repo on the Hub, named by ``--model`` (``hub_names``): its files and quantizations,
the one asked for, and what the fit needs to choose one when none is.

- ``repo_files``: the repo's file listing (the Hub's tree API, sizes and LFS sha256); offline,
  the finished files of that repo already in the cache, so an air-gapped machine runs it;
- ``gguf_quants``: its GGUF quantizations (``gguf_names.group_quants``: split parts together,
  vision projectors left out), or an error naming what the repo holds instead;
- ``select``: the quantization or file the name asks for (a pure decision), or None when the
  fit chooses;
- ``repo_shape`` and ``repo_entry``: the model's shape (layers, KV heads: what its KV cache
  needs) from the catalog entry of the same repo, a cached GGUF of it, or the GGUF header of
  its smallest quantization fetched by HTTP Range (a few MiB, never the weights), as the
  ``CatalogEntry`` ``fit.choose_quantization`` weighs.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from shoal.models.catalog import CatalogEntry, HubSource, ModelKind, QuantFile
from shoal.models.catalog_file import load_catalog
from shoal.models.errors import HubError, ModelError
from shoal.models.gguf_header import data_end
from shoal.models.gguf_info import ModelShape, read_shape
from shoal.models.gguf_names import (
    GGUF_SUFFIX,
    RepoFile,
    group_quants,
    guess_quantization,
    split_parts,
)
from shoal.models.hub import HubConfig, list_repo_files
from shoal.models.hub_cache import list_cached, read_stamp, repo_dir
from shoal.models.hub_names import HubName
from shoal.models.hub_ranges import HubFile, fetch_header

logger = logging.getLogger(__name__)

HEADER_FILE = "header.gguf"
_SHOWN = 8
"""Files named in the error for a repo without GGUF files."""


def repo_files(repo: str, cache_dir: Path, config: HubConfig) -> list[RepoFile]:
    """The files of ``repo``: the Hub's listing, or offline those finished in the cache."""
    if not config.offline:
        return list_repo_files(repo, config)
    found = [
        RepoFile(path, (folder / path).stat().st_size, _stamped_sha256(folder / path))
        for cached in list_cached(cache_dir)
        if cached.repo.lower() == repo.lower() and cached.complete
        for folder in (repo_dir(cache_dir, cached.repo),)
        for path in cached.files
    ]
    if not found:
        raise HubError(
            f"{repo} is not in the cache ({repo_dir(cache_dir, repo)}), and "
            f"{config.offline_reason}. Run `shoal models pull {repo}` (or `{repo}:QUANT`) "
            "while online, or copy its .gguf files there."
        )
    return found


def _stamped_sha256(path: Path) -> str | None:
    stamp = read_stamp(path)
    return stamp.sha256 if stamp is not None else None


def gguf_quants(repo: str, files: Sequence[RepoFile]) -> tuple[QuantFile, ...]:
    """The GGUF quantizations among ``files``; a ``HubError`` naming what the repo holds when
    there is none."""
    quants = group_quants(files)
    if quants:
        return quants
    names = [f.path for f in files]
    shown = ", ".join(names[:_SHOWN]) + (
        f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    )
    holds = f"it holds {shown}" if names else "it holds no files"
    raise HubError(
        f"{repo} has no GGUF model ({holds}). Shoal serves GGUF files: look for a GGUF "
        f"conversion of it (`shoal models search WORDS` lists GGUF repos on the Hub)."
    )


def select(
    name: HubName,
    files: Sequence[RepoFile],
    quants: Sequence[QuantFile],
    requested: str | None = None,
) -> QuantFile | None:
    """The files ``name`` (or ``--quantization``, ``requested``) asks for; None when neither
    names any, so the fit chooses. Raises ``ModelError`` listing what there is when the
    named quantization or file is not among ``files``."""
    wanted = name.quantization
    if requested is not None:
        if wanted is not None and wanted != requested.upper():
            raise ModelError(
                f"{name.id} names quantization {wanted} and --quantization says "
                f"{requested}; give one of them."
            )
        wanted = requested.upper()
    if name.file is not None:
        if wanted is not None:
            raise ModelError(f"{name.id} names a file; leave out --quantization.")
        return _file_quant(name, files)
    if wanted is None:
        return None
    found = next((q for q in quants if q.quantization.upper() == wanted), None)
    if found is None:
        have = ", ".join(q.quantization for q in quants)
        raise ModelError(
            f"{name.repo} has no {wanted} quantization; it has {have}. Name one of those "
            f"({name.repo}:{quants[0].quantization}), or none to run the one that fits."
        )
    return found


def _file_quant(name: HubName, files: Sequence[RepoFile]) -> QuantFile:
    """The named file with every part of its split GGUF, as one quantization."""
    assert name.file is not None
    by_path = {f.path.lower(): f for f in files}
    first = by_path.get(name.file.lower())
    if first is None:
        ggufs = ", ".join(f.path for f in files if f.path.lower().endswith(GGUF_SUFFIX))
        raise ModelError(f"{name.repo} has no file {name.file}; its GGUF files: {ggufs}.")
    parts = [by_path.get(p.lower()) for p in split_parts(first.path)]
    missing = [p for p, f in zip(split_parts(first.path), parts, strict=True) if f is None]
    if missing:
        raise ModelError(f"{name.repo} lacks {', '.join(missing)}, parts of {first.path}.")
    members = [f for f in parts if f is not None]
    hashes = tuple(f.sha256 for f in members if f.sha256 is not None)
    return QuantFile(
        quantization=guess_quantization(first.path) or PurePosixPath(first.path).stem,
        files=tuple(f.path for f in members),
        size_bytes=sum(f.size for f in members),
        size_exact=True,
        sha256=hashes if len(hashes) == len(members) else (),
    )


def repo_entry(repo: str, quants: Sequence[QuantFile], shape: ModelShape | None) -> CatalogEntry:
    """``repo`` as the fit weighs a catalog model: its quantizations and shape (without a
    shape the KV cache counts as nothing, and the caller has said so)."""
    known = shape or ModelShape("", 0, 0, 0, 0)
    return CatalogEntry(
        id=repo,
        name=repo,
        family="",
        kind=ModelKind.CHAT,
        parameters=0,
        context_length=known.context_length,
        license="",
        architecture=known.architecture,
        n_layers=known.n_layers,
        n_kv_heads=known.n_kv_heads,
        head_dim=known.head_dim,
        hub=HubSource(repo=repo, quants=tuple(quants)),
    )


def repo_shape(
    repo: str, quants: Sequence[QuantFile], cache_dir: Path, config: HubConfig
) -> ModelShape | None:
    """The model's shape without downloading it: the catalog's, a cached GGUF's, else its
    smallest quantization's header by Range; None (with a warning) when none can be had."""
    entry = next((e for e in load_catalog().entries if e.hub.repo.lower() == repo.lower()), None)
    if entry is not None:
        return ModelShape(
            entry.architecture,
            entry.n_layers,
            entry.n_kv_heads,
            entry.head_dim,
            entry.context_length,
        )
    for cached in list_cached(cache_dir):
        if cached.repo.lower() == repo.lower() and cached.complete:
            try:
                return read_shape(cached.path)
            except ModelError as exc:
                logger.debug("no shape from %s: %s", cached.path, exc)
    if not config.offline and quants:
        smallest = min(quants, key=lambda q: q.size_bytes)
        try:
            return _remote_shape(repo, smallest, config)
        except ModelError as exc:
            logger.warning("%s: cannot read its GGUF header (%s)", repo, exc)
    logger.warning(
        "%s: its shape is unknown, so the fit counts weights and compute but no KV cache", repo
    )
    return None


def _remote_shape(repo: str, quant: QuantFile, config: HubConfig) -> ModelShape:
    first = quant.files[0]
    sha256 = quant.sha256[0] if quant.sha256 else None
    header = fetch_header(HubFile(repo, first, "main", sha256, None), config)
    with tempfile.TemporaryDirectory(prefix="shoal-header-") as folder:
        path = Path(folder) / HEADER_FILE
        with path.open("wb") as out:  # sparse: the tensor table's offsets stay inside it
            out.truncate(max(len(header), data_end(header) or 0))
            out.write(header)
        return read_shape(path)
