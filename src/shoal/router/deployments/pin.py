"""Which exact file a split model's shards use: the one the router planned with.

A deployment names a catalog id; left to itself each machine would pick the quantization
that fits *it* (``models.fit``), and the head, the stages and the router's plan could name
different files, or different commits of one repo. So the router pins the file it resolved
(by the catalog and fit rules it plans with: ``models.resolve``) as a ``ModelFile`` in every
``ShardStart``: repo, file name, the commit its copy came from (else the catalog's branch),
sha256 and size. A path or a model-store id is passed on as it is (None).

``model_file`` is the decision (pure); ``pin_model`` reads what it needs (blocking).
"""

from __future__ import annotations

from pathlib import Path

from shoal.models.catalog import CatalogEntry
from shoal.models.catalog_file import load_catalog
from shoal.models.hub_cache import Stamp, read_stamp
from shoal.models.resolve import GGUF_SUFFIX, LocalModel, pypi_quantization, resolve_model
from shoal.protocol.messages import ModelFile


def model_file(
    source: str, entry: CatalogEntry | None, local: LocalModel, stamp: Stamp | None, size: int
) -> ModelFile | None:
    """The file every shard must use, from the router's copy ``local`` (``size`` bytes, with
    the hub cache's ``stamp`` if it has one); None when ``source`` is not a catalog id."""
    if entry is None or source.lower().endswith(GGUF_SUFFIX):
        return None
    wheel = pypi_quantization(entry)
    if local.decision is None:  # from the catalog model's PyPI wheel
        quantization = local.quantization or wheel or ""
        quant = entry.hub.quant(quantization)
        return ModelFile(
            source=source,
            kind="pypi",
            quantization=quantization,
            repo=entry.hub.repo,
            filename=quant.files[0] if quant is not None else local.path.name,
            revision=entry.hub.revision,
            sha256=quant.sha256[0] if quant is not None and quant.sha256 else None,
            size=size,
        )
    quant = local.decision.quant
    filename = quant.files[0]
    sha256 = quant.sha256[0] if quant.sha256 else None
    revision = entry.hub.revision
    if stamp is not None and stamp.repo == entry.hub.repo and stamp.file == filename:
        revision = stamp.commit or stamp.revision
        sha256 = stamp.sha256
    return ModelFile(
        source=source,
        kind="hub",
        quantization=quant.quantization,
        repo=entry.hub.repo,
        filename=filename,
        revision=revision,
        sha256=sha256,
        size=size,
    )


def pin_model(source: str, cache_dir: Path) -> ModelFile | None:
    """``model_file`` for ``source`` as the router resolves it from its cache (nothing is
    downloaded). Raises ``ModelError`` when it cannot be resolved."""
    local = resolve_model(source, cache_dir, download=False)
    entry = None if source.lower().endswith(GGUF_SUFFIX) else load_catalog().get(source)
    return model_file(source, entry, local, read_stamp(local.path), local.path.stat().st_size)
