"""Turning what a user typed for ``--model`` into a GGUF file on this machine."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from shoal.models.default import KNOWN_MODELS
from shoal.models.errors import ModelError
from shoal.models.gguf_info import check_magic
from shoal.models.pypi import cached_model, ensure_model

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class LocalModel:
    """A model ready to load: its id (what clients send as ``model``) and its GGUF file."""

    id: str
    path: Path


def resolve_model(model: str, cache_dir: Path, *, download: bool = True) -> LocalModel:
    """Resolve a ``.gguf`` path or a known model id to a local, verified GGUF file.

    A path's id is its file name without ``.gguf``, lowercased. A known id is fetched into
    the cache unless ``download`` is False, in which case it must already be there.
    """
    if model.lower().endswith(GGUF_SUFFIX):
        return _from_file(Path(model).expanduser())
    spec = KNOWN_MODELS.get(model.lower())
    if spec is None:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ModelError(
            f"unknown model {model!r}. Known models: {known}. "
            f"The path of a {GGUF_SUFFIX} file works too."
        )
    if download:
        path = ensure_model(spec, cache_dir)
    else:
        cached = cached_model(spec, cache_dir)
        if cached is None:
            raise ModelError(
                f"model {spec.id} is not downloaded yet; run `shoal models pull {spec.id}`."
            )
        path = cached
    return LocalModel(id=spec.id, path=path)


def _from_file(path: Path) -> LocalModel:
    if not path.is_file():
        raise ModelError(
            f"model file {path} does not exist. Pass an existing {GGUF_SUFFIX} file or a "
            f"known model name ({', '.join(sorted(KNOWN_MODELS))})."
        )
    check_magic(path)
    local = LocalModel(id=path.stem.lower(), path=path.absolute())
    logger.info("model %s from file %s", local.id, local.path)
    return local
