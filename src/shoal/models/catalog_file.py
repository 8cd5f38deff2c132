"""Reading ``catalog.json`` (``load_catalog``, once per process): strict checks that turn it into
the catalog dataclasses of ``catalog``.

Every problem raises ``CatalogError`` naming the entry id and the field, so a bad regeneration
of the data fails at import-time tests rather than as a confusing download error later.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from importlib import resources
from typing import Any

from shoal.models.catalog import (
    BITS_PER_WEIGHT,
    CATALOG_RESOURCE,
    QUANT_PREFERENCE,
    SCHEMA_VERSION,
    Catalog,
    CatalogEntry,
    CatalogError,
    HubSource,
    ModelKind,
    QuantFile,
)
from shoal.models.default import DEFAULT_MODEL
from shoal.models.spec import ModelSpec

logger = logging.getLogger(__name__)

ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
REPO_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
SPLIT_PATTERN = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$")
PYPI_MIRRORS: dict[str, ModelSpec] = {"default": DEFAULT_MODEL}
"""Names a catalog entry's ``pypi`` field may use, and the ModelSpec each stands for."""

_ENTRY_KEYS = {
    "id": str,
    "name": str,
    "family": str,
    "kind": str,
    "parameters": int,
    "context_length": int,
    "license": str,
    "architecture": str,
    "n_layers": int,
    "n_kv_heads": int,
    "head_dim": int,
    "hub": dict,
    "pypi": (str, type(None)),
    "description": str,
    "base_model": str,
}
_HUB_KEYS = {"repo": str, "revision": str, "quants": list}
_QUANT_KEYS = {
    "quantization": str,
    "files": list,
    "size_bytes": int,
    "size_exact": bool,
    "sha256": list,
}
_POSITIVE = ("parameters", "context_length", "n_layers", "n_kv_heads", "head_dim")


class _Bad(Exception):
    """A problem inside one entry; the caller adds the entry id."""


def parse_document(document: object) -> tuple[CatalogEntry, ...]:
    """Validate the whole JSON document and build its entries (ids unique, sorted)."""
    if not isinstance(document, dict) or document.get("schema") != SCHEMA_VERSION:
        raise CatalogError(
            f"{CATALOG_RESOURCE} must be an object with schema={SCHEMA_VERSION}; "
            "regenerate it with scripts/catalog/build_catalog.py."
        )
    raw_entries = document.get("entries")
    if not isinstance(raw_entries, list) or not raw_entries:
        raise CatalogError(f"{CATALOG_RESOURCE} has no 'entries' list.")
    entries: list[CatalogEntry] = []
    seen: set[str] = set()
    for index, raw in enumerate(raw_entries):
        label = raw.get("id", f"#{index}") if isinstance(raw, dict) else f"#{index}"
        try:
            entry = _entry(raw)
        except _Bad as exc:
            raise CatalogError(f"{CATALOG_RESOURCE}: entry {label!r}: {exc}") from exc
        if entry.id in seen:
            raise CatalogError(f"{CATALOG_RESOURCE}: entry {entry.id!r} appears twice.")
        seen.add(entry.id)
        entries.append(entry)
    return tuple(entries)


def _fields(raw: object, spec: dict[str, Any], what: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise _Bad(f"{what} must be an object")
    missing = sorted(set(spec) - set(raw))
    unknown = sorted(set(raw) - set(spec))
    if missing or unknown:
        raise _Bad(f"{what}: missing fields {missing}, unknown fields {unknown}")
    for key, kind in spec.items():
        value = raw[key]
        # bool is an int subclass: a true/false where a number belongs is still an error.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise _Bad(f"{what}.{key} has the wrong type ({type(value).__name__})")
    return raw


def _entry(raw: object) -> CatalogEntry:
    data = _fields(raw, _ENTRY_KEYS, "entry")
    if not ID_PATTERN.match(data["id"]):
        raise _Bad("id must be lower-case letters, digits, '.', '_' or '-'")
    for key in _POSITIVE:
        if data[key] <= 0:
            raise _Bad(f"{key} must be positive, not {data[key]}")
    for key in ("name", "family", "license", "architecture"):
        if not data[key].strip():
            raise _Bad(f"{key} is empty")
    try:
        kind = ModelKind(data["kind"])
    except ValueError:
        raise _Bad(f"kind {data['kind']!r} is not one of {[k.value for k in ModelKind]}") from None
    hub = _hub(data["hub"])
    pypi = _pypi(data["pypi"], hub)
    values = {key: data[key] for key in _ENTRY_KEYS if key not in ("kind", "hub", "pypi")}
    return CatalogEntry(kind=kind, hub=hub, pypi=pypi, **values)


def _hub(raw: object) -> HubSource:
    data = _fields(raw, _HUB_KEYS, "hub")
    if not REPO_PATTERN.match(data["repo"]):
        raise _Bad(f"hub.repo {data['repo']!r} is not an 'owner/name' Hugging Face repo")
    quants = tuple(_quant(item) for item in data["quants"])
    if not quants:
        raise _Bad("hub.quants is empty")
    names = [q.quantization for q in quants]
    if len(set(names)) != len(names):
        raise _Bad(f"hub.quants lists a quantization twice: {names}")
    return HubSource(repo=data["repo"], quants=quants, revision=data["revision"] or "main")


def _quant(raw: object) -> QuantFile:
    data = _fields(raw, _QUANT_KEYS, "quant")
    name = data["quantization"]
    if name not in BITS_PER_WEIGHT or name not in QUANT_PREFERENCE:
        raise _Bad(f"unknown quantization {name!r}")
    files = tuple(data["files"])
    check_files(files)
    if data["size_bytes"] <= 0:
        raise _Bad(f"{name}: size_bytes must be positive")
    sha256 = tuple(data["sha256"])
    if sha256 and (len(sha256) != len(files) or not all(_is_sha(s) for s in sha256)):
        raise _Bad(f"{name}: sha256 must list one lower-case hex digest per file")
    return QuantFile(name, files, data["size_bytes"], data["size_exact"], sha256)


def check_files(files: tuple[str, ...]) -> None:
    """One ``.gguf`` file, or every part of one split GGUF in order (1..N of N)."""
    if not files or not all(isinstance(f, str) and f.endswith(".gguf") for f in files):
        raise _Bad(f"files must be one or more .gguf paths: {list(files)}")
    parts = [SPLIT_PATTERN.match(f) for f in files]
    if len(files) == 1 and parts[0] is None:
        return
    if any(p is None for p in parts):
        raise _Bad(f"several files that are not the parts of one split GGUF: {list(files)}")
    matches = [p for p in parts if p is not None]
    stems = {m["stem"] for m in matches}
    totals = {int(m["total"]) for m in matches}
    numbers = [int(m["part"]) for m in matches]
    if len(stems) != 1 or totals != {len(files)} or numbers != list(range(1, len(files) + 1)):
        raise _Bad(f"split GGUF parts are incomplete or out of order: {list(files)}")


def _is_sha(value: object) -> bool:
    return isinstance(value, str) and SHA256_PATTERN.match(value) is not None


def _pypi(raw: str | None, hub: HubSource) -> ModelSpec | None:
    if raw is None:
        return None
    spec = PYPI_MIRRORS.get(raw)
    if spec is None:
        raise _Bad(f"pypi {raw!r} is not one of {sorted(PYPI_MIRRORS)}")
    if not any(spec.filename in q.files and spec.size == q.size_bytes for q in hub.quants):
        raise _Bad(f"pypi mirror {spec.filename} ({spec.size} bytes) is not among hub.quants")
    return spec


def parse_catalog(text: str) -> Catalog:
    """Parse and validate catalog JSON text; raise CatalogError naming the bad entry."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CatalogError(f"{CATALOG_RESOURCE} is not valid JSON: {exc}. {_FIX}") from exc
    return Catalog(entries=parse_document(document))


@functools.cache
def load_catalog() -> Catalog:
    """The catalog shipped with Shoal, read and validated once per process."""
    resource = resources.files(__package__).joinpath(CATALOG_RESOURCE)
    try:
        text = resource.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise CatalogError(f"{CATALOG_RESOURCE} is missing from the shoal package. {_FIX}") from exc
    catalog = parse_catalog(text)
    logger.debug("loaded model catalog: %d entries", len(catalog.entries))
    return catalog


_FIX = "Reinstall shoal, or regenerate it with scripts/catalog/build_catalog.py."
