#!/usr/bin/env python3
"""Regenerate src/shoal/models/catalog.json from the curated seeds in seeds.json.

Standard library only. Every field's origin is documented in README.md beside this script:

* seeds.json (curated by hand, with the evidence for each repo in its ``evidence`` field):
  id, name, family, kind, license, description, the GGUF repo, the file-name template and
  the quantizations to list, the base-model repo, and the well-known shape of the model.
* The Hugging Face Hub, when online (the default): ``GET {HF_ENDPOINT}/api/models/{repo}/
  tree/{revision}?recursive=true`` gives each file's path, exact size and LFS sha256 (split
  GGUFs: every ``-0000K-of-0000N`` part); ``GET {HF_ENDPOINT}/{base}/resolve/main/
  config.json`` gives layers, KV heads and head dim; ``GET {HF_ENDPOINT}/api/models/{base}``
  gives the safetensors parameter count.
* Offline (``--offline``, or a Hub request that fails), each quantization keeps what the
  existing catalog.json says if its file list is unchanged, else a size the seed records from
  a cited source, else an estimate: parameters x bits-per-weight / 8, marked size_exact=false.

Usage:  python scripts/catalog/build_catalog.py [--offline] [--only ID ...] [--output PATH]
Environment: HF_ENDPOINT (default https://huggingface.co), HF_TOKEN (for gated base repos).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

logger = logging.getLogger("build_catalog")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEFAULT_SEEDS = HERE / "seeds.json"
DEFAULT_OUTPUT = ROOT / "src" / "shoal" / "models" / "catalog.json"
DEFAULT_ENDPOINT = "https://huggingface.co"
HTTP_TIMEOUT_S = 30.0
GENERATED_BY = "scripts/catalog/build_catalog.py"

# Same table as shoal.models.catalog.BITS_PER_WEIGHT (llama.cpp tools/quantize/README.md,
# measured on Llama-3.1-8B); copied so the script runs without Shoal installed.
BITS_PER_WEIGHT = {
    "F32": 32.0, "F16": 16.0005, "BF16": 16.0, "Q8_0": 8.5008, "Q6_K": 6.5633,
    "Q5_K_M": 5.7036, "Q5_K_S": 5.5704, "Q5_1": 6.0376, "Q5_0": 5.5674, "Q4_K_M": 4.8944,
    "Q4_K_S": 4.6672, "IQ4_XS": 4.4597, "IQ4_NL": 4.6818, "Q4_1": 5.1080, "Q4_0": 4.6378,
    "Q3_K_L": 4.2979, "Q3_K_M": 3.9986, "IQ3_M": 3.7628, "IQ3_S": 3.6606, "IQ3_XS": 3.4977,
    "Q3_K_S": 3.6429, "IQ3_XXS": 3.2548, "Q2_K": 3.1593, "Q2_K_S": 2.9697, "IQ2_M": 2.9294,
    "IQ2_S": 2.7403, "IQ2_XS": 2.5882, "IQ2_XXS": 2.3824, "IQ1_M": 2.1460, "IQ1_S": 2.0042,
}  # fmt: skip
SEED_KEYS = {
    "id", "name", "family", "kind", "license", "architecture", "parameters", "context_length",
    "n_layers", "n_kv_heads", "head_dim", "base_model", "repo", "file", "quant_case", "quants",
    "split", "split_dir", "known", "pypi", "description", "evidence", "float_case",
}  # fmt: skip
SHAPE_KEYS = ("n_layers", "n_kv_heads", "head_dim")


class HubError(Exception):
    """A Hub request failed (network, HTTP status or unexpected JSON)."""


class Hub:
    """The few Hugging Face Hub endpoints the catalog needs, over urllib."""

    def __init__(self, endpoint: str, token: str | None) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.token = token

    def _get(self, url: str) -> tuple[Any, str | None]:
        request = urllib.request.Request(url, headers={"User-Agent": "shoal-catalog/1"})
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                body = response.read()
                link = response.headers.get("Link")
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise HubError(f"GET {url}: {exc}") from exc
        try:
            return json.loads(body), _next_link(link)
        except json.JSONDecodeError as exc:
            raise HubError(f"GET {url}: not JSON ({exc})") from exc

    def tree(self, repo: str, revision: str) -> dict[str, dict[str, Any]]:
        """Every file of the repo: path -> {"size": int, "sha256": str | None}."""
        quoted = urllib.parse.quote(revision, safe="")
        url: str | None = f"{self.endpoint}/api/models/{repo}/tree/{quoted}?recursive=true"
        files: dict[str, dict[str, Any]] = {}
        while url:
            items, url = self._get(url)
            if not isinstance(items, list):
                raise HubError(f"tree of {repo}: expected a list")
            for item in items:
                if item.get("type") == "file":
                    lfs = item.get("lfs") or {}
                    files[item["path"]] = {"size": int(item["size"]), "sha256": lfs.get("oid")}
        return files

    def config(self, repo: str) -> dict[str, Any]:
        data, _ = self._get(f"{self.endpoint}/{repo}/resolve/main/config.json")
        if not isinstance(data, dict):
            raise HubError(f"config.json of {repo}: expected an object")
        return data

    def parameters(self, repo: str) -> int | None:
        data, _ = self._get(f"{self.endpoint}/api/models/{repo}")
        total = (data.get("safetensors") or {}).get("total") if isinstance(data, dict) else None
        return int(total) if isinstance(total, int) and total > 0 else None


def _next_link(header: str | None) -> str | None:
    match = re.search(r'<([^>]+)>;\s*rel="next"', header or "")
    return match.group(1) if match else None


FLOAT_TYPES = ("F32", "F16", "BF16")


def file_name(seed: dict[str, Any], quant: str) -> str:
    """The seed's file template with the quantization, in the publisher's letter case.

    Publishers write k-quants upper-case (``Q4_K_M``) unless ``quant_case`` is "lower", and
    the unquantized types lower-case (``f16``) unless ``float_case`` is "upper".
    """
    if quant in FLOAT_TYPES:
        text = quant if seed.get("float_case") == "upper" else quant.lower()
    else:
        text = quant.lower() if seed.get("quant_case") == "lower" else quant
    return str(seed["file"]).replace("{quant}", text)


def same_quant(seed: dict[str, Any], quant: str, files: list[str]) -> bool:
    """Whether ``files`` (from an earlier run) are this quantization's file or split parts."""
    name = file_name(seed, quant)
    part = re.compile(rf"^{re.escape(name.removesuffix('.gguf'))}-\d{{5}}-of-\d{{5}}\.gguf$")
    bases = [f.rsplit("/", 1)[-1] for f in files]
    return bases == [name] or (bool(bases) and all(part.match(b) for b in bases))


def expected_files(seed: dict[str, Any], quant: str) -> list[str]:
    """The paths the seed says a quantization has (several when it is split)."""
    name = file_name(seed, quant)
    parts = int(seed.get("split", {}).get(quant, 1))
    if parts == 1:
        return [name]
    stem = name.removesuffix(".gguf")
    folder = f"{stem}/" if seed.get("split_dir") else ""
    return [f"{folder}{stem}-{i:05d}-of-{parts:05d}.gguf" for i in range(1, parts + 1)]


def files_in_tree(seed: dict[str, Any], quant: str, tree: dict[str, Any]) -> list[str]:
    """The quantization's files as the Hub tree has them: one file or all split parts."""
    name = file_name(seed, quant)
    if name in tree:
        return [name]
    stem = re.escape(name.removesuffix(".gguf"))
    part = re.compile(rf"^(?:.*/)?{stem}-(\d{{5}})-of-(\d{{5}})\.gguf$")
    parts = sorted(p for p in tree if part.match(p))
    if not parts:
        return []
    total = int(part.match(parts[0]).group(2))  # type: ignore[union-attr]  # matched above
    numbers = [int(part.match(p).group(1)) for p in parts]  # type: ignore[union-attr]
    if numbers != list(range(1, total + 1)):
        logger.warning("%s %s: incomplete split %s; skipped", seed["id"], quant, parts)
        return []
    return parts


def quant_from_tree(
    seed: dict[str, Any], quant: str, tree: dict[str, Any]
) -> dict[str, Any] | None:
    files = files_in_tree(seed, quant, tree)
    if not files:
        logger.warning("%s: %s has no %s file; dropped", seed["id"], seed["repo"], quant)
        return None
    shas = [tree[f]["sha256"] for f in files]
    return {
        "quantization": quant,
        "files": files,
        "size_bytes": sum(tree[f]["size"] for f in files),
        "size_exact": True,
        "sha256": shas if all(shas) else [],
    }


def quant_offline(
    seed: dict[str, Any], quant: str, previous: dict[str, Any] | None
) -> dict[str, Any]:
    files = expected_files(seed, quant)
    if previous is not None and same_quant(seed, quant, previous["files"]):
        return previous
    known = seed.get("known", {}).get(quant)
    if known is not None:
        sha = known.get("sha256")
        return {
            "quantization": quant,
            "files": files,
            "size_bytes": int(known["size"]),
            "size_exact": True,
            "sha256": [sha] if sha and len(files) == 1 else [],
        }
    size = round(int(seed["parameters"]) * BITS_PER_WEIGHT[quant] / 8)
    return {"quantization": quant, "files": files, "size_bytes": size, "size_exact": False,
            "sha256": []}  # fmt: skip


def shape_from_config(config: dict[str, Any]) -> dict[str, int]:
    """n_layers, n_kv_heads, head_dim (and context) from a transformers config.json."""
    text = config.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" in text:
        config = {**config, **text}
    heads = config.get("num_attention_heads") or config.get("n_head")
    layers = config.get("num_hidden_layers") or config.get("n_layer")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim")
    if not head_dim and heads and config.get("hidden_size"):
        head_dim = int(config["hidden_size"]) // int(heads)
    shape = {"n_layers": layers, "n_kv_heads": kv_heads, "head_dim": head_dim}
    result = {k: int(v) for k, v in shape.items() if isinstance(v, int) and v > 0}
    if isinstance(config.get("max_position_embeddings"), int):
        result["max_position_embeddings"] = config["max_position_embeddings"]
    return result


def online_facts(seed: dict[str, Any], hub: Hub) -> dict[str, int]:
    """Shape and parameter count from the base repo; {} for what the Hub would not give."""
    facts: dict[str, int] = {}
    base = seed["base_model"]
    try:
        shape = shape_from_config(hub.config(base))
        facts.update({k: v for k, v in shape.items() if k in SHAPE_KEYS})
    except HubError as exc:
        logger.warning("%s: config.json of %s unavailable (%s); seed shape kept", seed["id"],
                       base, exc)  # fmt: skip
    try:
        parameters = hub.parameters(base)
    except HubError as exc:
        logger.warning("%s: parameter count of %s unavailable (%s)", seed["id"], base, exc)
        parameters = None
    if parameters:
        facts["parameters"] = parameters
    return facts


def build_entry(
    seed: dict[str, Any], previous: dict[str, Any] | None, hub: Hub | None
) -> dict[str, Any]:
    facts = online_facts(seed, hub) if hub else {}
    entry = {key: seed[key] for key in ("id", "name", "family", "kind", "license", "architecture")}
    for key in ("parameters", "context_length", *SHAPE_KEYS):
        entry[key] = int(facts.get(key, seed[key]))
    entry.update(
        base_model=seed["base_model"],
        description=seed.get("description", ""),
        pypi=seed.get("pypi"),
        hub={"repo": seed["repo"], "revision": "main", "quants": []},
    )
    old_quants = {q["quantization"]: q for q in (previous or {}).get("hub", {}).get("quants", [])}
    tree = None
    if hub is not None:
        try:
            tree = hub.tree(seed["repo"], "main")
        except HubError as exc:
            logger.warning("%s: tree of %s unavailable (%s); offline data kept", seed["id"],
                           seed["repo"], exc)  # fmt: skip
    for quant in seed["quants"]:
        if tree is not None:
            item = quant_from_tree(seed, quant, tree)
        else:
            item = quant_offline({**seed, **entry}, quant, old_quants.get(quant))
        if item is not None:
            entry["hub"]["quants"].append(item)
    if not entry["hub"]["quants"]:
        raise SystemExit(f"{seed['id']}: none of {seed['quants']} found in {seed['repo']}")
    return entry


def check_seed(seed: dict[str, Any]) -> None:
    unknown = set(seed) - SEED_KEYS
    missing = {"id", "repo", "file", "quants", "base_model", "parameters"} - set(seed)
    bad = [q for q in seed.get("quants", []) if q not in BITS_PER_WEIGHT]
    if unknown or missing or bad or "{quant}" not in str(seed.get("file")):
        raise SystemExit(f"seed {seed.get('id')}: unknown {unknown}, missing {missing}, "
                         f"bad quants {bad}, or no {{quant}} in 'file'")  # fmt: skip


def render(entries: list[dict[str, Any]]) -> str:
    """Deterministic JSON: entries sorted by id, keys sorted, one quantization per line."""
    compact: dict[str, str] = {}
    ordered = []
    for entry in sorted(entries, key=lambda e: e["id"]):
        quants = []
        for quant in entry["hub"]["quants"]:
            token = f"@quant{len(compact)}@"
            compact[f'"{token}"'] = json.dumps(quant, sort_keys=True, ensure_ascii=False)
            quants.append(token)
        ordered.append({**entry, "hub": {**entry["hub"], "quants": quants}})
    document = {"schema": 1, "generated_by": GENERATED_BY, "entries": ordered}
    text = json.dumps(document, indent=1, sort_keys=True, ensure_ascii=False)
    text = re.sub(r'"@quant\d+@"', lambda m: compact[m.group(0)], text)
    return text + "\n"


def load_previous(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    return {entry["id"]: entry for entry in json.loads(path.read_text("utf-8"))["entries"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=Path, default=DEFAULT_SEEDS)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--offline", action="store_true", help="ask the Hub nothing")
    parser.add_argument("--only", nargs="*", default=None, help="refresh only these ids")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    seeds = json.loads(args.seeds.read_text("utf-8"))["models"]
    for seed in seeds:
        check_seed(seed)
    previous = load_previous(args.output)
    endpoint = os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    hub = None if args.offline else Hub(endpoint, os.environ.get("HF_TOKEN") or None)
    entries = []
    for seed in seeds:
        refresh = args.only is None or seed["id"] in args.only
        if not refresh and seed["id"] in previous:
            entries.append(previous[seed["id"]])
            continue
        entries.append(build_entry(seed, previous.get(seed["id"]), hub if refresh else None))
    args.output.write_text(render(entries), encoding="utf-8")
    exact = sum(q["size_exact"] for e in entries for q in e["hub"]["quants"])
    total = sum(len(e["hub"]["quants"]) for e in entries)
    logger.info("wrote %s: %d entries, %d/%d sizes exact", args.output, len(entries), exact, total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
