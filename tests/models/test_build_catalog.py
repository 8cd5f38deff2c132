"""scripts/catalog/build_catalog.py against a FAKE Hugging Face Hub on 127.0.0.1.

FAKE: ``FakeHub`` below imitates the three Hub endpoints the script uses, with the JSON
shapes huggingface.co returns: ``GET /api/models/{repo}/tree/main?recursive=true`` (a list of
``{"type", "path", "size", "lfs": {"oid"}}``, paginated with a ``Link: <...>; rel="next"``
header), ``GET /{repo}/resolve/main/config.json`` and ``GET /api/models/{repo}`` (with
``safetensors.total``). It serves two made-up repos; nothing leaves the machine.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from shoal.models.catalog import estimate_size
from shoal.models.catalog_file import parse_catalog

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "catalog" / "build_catalog.py"
SHA = {name: f"{i:x}" * 64 for i, name in enumerate("abcdef", start=1)}

TREES: dict[str, list[dict[str, Any]]] = {
    "fake/Tiny-GGUF": [
        {"type": "file", "path": "README.md", "size": 10},
        {"type": "file", "path": "Tiny-Q4_K_M.gguf", "size": 1000, "lfs": {"oid": SHA["a"]}},
        {"type": "file", "path": "Tiny-Q8_0.gguf", "size": 2000, "lfs": {"oid": SHA["b"]}},
    ],
    "fake/Big-GGUF": [
        {"type": "directory", "path": "Big-Q8_0"},
        {
            "type": "file",
            "path": "Big-Q8_0/Big-Q8_0-00002-of-00002.gguf",
            "size": 700,
            "lfs": {"oid": SHA["d"]},
        },  # fmt: skip
        {
            "type": "file",
            "path": "Big-Q8_0/Big-Q8_0-00001-of-00002.gguf",
            "size": 900,
            "lfs": {"oid": SHA["c"]},
        },  # fmt: skip
        {"type": "file", "path": "Big-Q4_K_M.gguf", "size": 500, "lfs": {"oid": SHA["e"]}},
    ],
}
CONFIGS = {
    "base/Tiny": {
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_size": 576,
        "max_position_embeddings": 8192,
    },  # fmt: skip
    # A multimodal config: the text model's shape is nested, head_dim given explicitly.
    "base/Big": {
        "text_config": {
            "num_hidden_layers": 62,
            "num_attention_heads": 32,
            "num_key_value_heads": 16,
            "head_dim": 128,
        }
    },  # fmt: skip
}
PARAMETERS = {"base/Tiny": 134_515_008}


class FakeHub(BaseHTTPRequestHandler):
    requests: list[str] = []

    def do_GET(self) -> None:
        FakeHub.requests.append(self.path)
        path, _, query = self.path.partition("?")
        if path.startswith("/api/models/") and "/tree/main" in path:
            self._tree(path.removeprefix("/api/models/").split("/tree/")[0], query)
        elif path.startswith("/api/models/"):
            repo = path.removeprefix("/api/models/")
            total = PARAMETERS.get(repo)
            self._json({"id": repo, "safetensors": {"total": total}} if total else None)
        elif path.endswith("/resolve/main/config.json"):
            self._json(CONFIGS.get(path.strip("/").removesuffix("/resolve/main/config.json")))
        else:
            self._json(None)

    def _tree(self, repo: str, query: str) -> None:
        items = TREES.get(repo)
        if items is None:
            self._json(None)
            return
        # Two pages, like the Hub's cursor pagination: the first says where the next is.
        if "cursor=2" in query:
            self._json(items[2:])
        else:
            port = self.server.server_address[1]  # type: ignore[index]  # an (ip, port) pair
            nxt = f"http://127.0.0.1:{port}/api/models/{repo}/tree/main?recursive=true&cursor=2"
            self._json(items[:2], link=f'<{nxt}>; rel="next"')

    def _json(self, body: object, link: str | None = None) -> None:
        data = json.dumps(body if body is not None else {"error": "not found"}).encode()
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if link:
            self.send_header("Link", link)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_TOKEN", "")
    FakeHub.requests = []
    try:
        yield endpoint
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_catalog", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def seed(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "Tiny",
        "family": "smollm",
        "kind": "chat",
        "license": "apache-2.0",
        "architecture": "llama",
        "parameters": 100_000_000,
        "context_length": 8192,
        "n_layers": 1,
        "n_kv_heads": 1,
        "head_dim": 64,
        "description": "a made-up model",
        "evidence": "test",
    }
    return {**base, **fields}


TINY = seed(
    id="tiny",
    repo="fake/Tiny-GGUF",
    base_model="base/Tiny",
    file="Tiny-{quant}.gguf",
    quants=["Q8_0", "Q4_K_M", "Q2_K"],
)
BIG = seed(
    id="big",
    name="Big",
    repo="fake/Big-GGUF",
    base_model="base/Big",
    file="Big-{quant}.gguf",
    quants=["Q8_0", "Q4_K_M"],
    split={"Q8_0": 2},
    split_dir=True,
)


def run(
    script: ModuleType, tmp_path: Path, seeds: list[dict[str, Any]], *flags: str
) -> dict[str, Any]:
    seeds_path = tmp_path / "seeds.json"
    seeds_path.write_text(json.dumps({"models": seeds}))
    output = tmp_path / "catalog.json"
    assert script.main(["--seeds", str(seeds_path), "--output", str(output), *flags]) == 0
    document: dict[str, Any] = json.loads(output.read_text())
    return {entry["id"]: entry for entry in document["entries"]}


def quants(entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {q["quantization"]: q for q in entry["hub"]["quants"]}


def test_online_fills_exact_sizes_split_parts_and_shapes(
    script: ModuleType, tmp_path: Path, fake_hub: str
) -> None:
    entries = run(script, tmp_path, [TINY, BIG])

    tiny = entries["tiny"]
    assert quants(tiny)["Q4_K_M"] == {
        "quantization": "Q4_K_M",
        "files": ["Tiny-Q4_K_M.gguf"],
        "size_bytes": 1000,
        "size_exact": True,
        "sha256": [SHA["a"]],
    }
    assert quants(tiny)["Q8_0"]["size_bytes"] == 2000
    assert "Q2_K" not in quants(tiny), "a quantization the repo lacks is dropped"
    assert (tiny["n_layers"], tiny["n_kv_heads"], tiny["head_dim"]) == (30, 3, 64)
    assert tiny["parameters"] == 134_515_008

    big = entries["big"]
    q8 = quants(big)["Q8_0"]
    assert q8["files"] == [
        "Big-Q8_0/Big-Q8_0-00001-of-00002.gguf",
        "Big-Q8_0/Big-Q8_0-00002-of-00002.gguf",
    ]
    assert q8["size_bytes"] == 1600 and q8["size_exact"]
    assert q8["sha256"] == [SHA["c"], SHA["d"]]
    assert (big["n_layers"], big["n_kv_heads"], big["head_dim"]) == (62, 16, 128)
    assert big["parameters"] == 100_000_000, "no safetensors total: the seed's count is kept"

    assert any("cursor=2" in r for r in FakeHub.requests), "the tree's second page was read"
    text = (tmp_path / "catalog.json").read_text()
    assert len(parse_catalog(text).entries) == 2


def test_output_is_deterministic(script: ModuleType, tmp_path: Path, fake_hub: str) -> None:
    run(script, tmp_path, [BIG, TINY])
    first = (tmp_path / "catalog.json").read_text()
    (tmp_path / "catalog.json").unlink()
    run(script, tmp_path, [TINY, BIG])
    assert (tmp_path / "catalog.json").read_text() == first
    assert list(json.loads(first)["entries"][0]) == sorted(json.loads(first)["entries"][0])


def test_offline_keeps_exact_data_and_estimates_the_rest(
    script: ModuleType, tmp_path: Path, fake_hub: str
) -> None:
    run(script, tmp_path, [TINY, BIG])
    FakeHub.requests = []
    newcomer = seed(
        id="new",
        repo="fake/New-GGUF",
        base_model="base/New",
        file="New.{quant}.gguf",
        quants=["Q4_K_M", "Q4_1"],
        known={"Q4_1": {"size": 4321, "source": "a test"}},
    )
    entries = run(script, tmp_path, [TINY, BIG, newcomer], "--offline")

    assert FakeHub.requests == [], "offline asks the Hub nothing"
    assert quants(entries["big"])["Q8_0"]["size_bytes"] == 1600
    assert quants(entries["big"])["Q8_0"]["size_exact"]
    assert entries["tiny"]["n_layers"] == 1, "offline, the seed's shape is what we have"
    new = quants(entries["new"])
    assert new["Q4_1"]["size_bytes"] == 4321 and new["Q4_1"]["size_exact"]
    assert new["Q4_K_M"] == {
        "quantization": "Q4_K_M",
        "files": ["New.Q4_K_M.gguf"],
        "size_bytes": estimate_size(100_000_000, "Q4_K_M"),
        "size_exact": False,
        "sha256": [],
    }


def test_unreachable_hub_falls_back_to_offline_data(
    script: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused
    entries = run(script, tmp_path, [BIG])
    q8 = quants(entries["big"])["Q8_0"]
    assert q8["files"] == [
        "Big-Q8_0/Big-Q8_0-00001-of-00002.gguf",
        "Big-Q8_0/Big-Q8_0-00002-of-00002.gguf",
    ]
    assert not q8["size_exact"]


def test_bad_seeds_are_refused(script: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="bad quants"):
        run(script, tmp_path, [{**TINY, "quants": ["Q9_K"]}], "--offline")
    with pytest.raises(SystemExit, match="unknown"):
        run(script, tmp_path, [{**TINY, "typo": 1}], "--offline")
