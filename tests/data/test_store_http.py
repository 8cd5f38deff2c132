"""The store's read API over real HTTP: registry, metadata, tensors, pull plans, byte ranges."""

from __future__ import annotations

from pathlib import Path

import pytest
from stores import MODEL_ID, READ_KEY, TINY_ID, StartStore, StoreServer

from shoal.models.byte_ranges import merge_ranges
from shoal.models.gguf_info import GGUFInfo, inspect
from shoal.models.store_client import PullPlan, fetch_ranges, request_pull
from shoal.pip_download import file_sha256


def _error(payload: dict[str, object]) -> dict[str, object]:
    error = payload["error"]
    assert isinstance(error, dict)
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def test_registry_lists_every_gguf(own_store: StoreServer, model_path: Path) -> None:
    store = own_store
    (store.storage / "notes.txt").write_text("not a model")
    r = await store.client.get("/api/v1/models/registry")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    by_id = {e["id"]: e for e in body["data"]}
    assert set(by_id) == {MODEL_ID, TINY_ID}
    assert by_id[MODEL_ID] == {
        "id": MODEL_ID,
        "filename": f"{MODEL_ID}.gguf",
        "size": 98_362_432,
        "sha256": file_sha256(model_path),
        "architecture": "llama",
        "n_layers": 30,
        "quantization": "Q4_1",
    }
    assert (by_id[TINY_ID]["n_layers"], by_id[TINY_ID]["quantization"]) == (3, "F32")
    sidecar = store.storage / f".{MODEL_ID}.gguf.sha256"
    assert file_sha256(model_path) in sidecar.read_text()


async def test_metadata_and_tensors(store: StoreServer) -> None:
    info = inspect(store.storage / f"{MODEL_ID}.gguf")
    meta = (await store.client.get(f"/api/v1/models/{MODEL_ID}/metadata")).json()
    assert "tensors" not in meta and "path" not in meta
    assert (meta["id"], meta["filename"]) == (MODEL_ID, f"{MODEL_ID}.gguf")
    assert (meta["n_layers"], meta["data_offset"], meta["tied_embeddings"]) == (30, 1785664, True)
    assert meta["metadata"]["general.architecture"] == "llama"
    assert meta["layers"][2] == {
        "layer": 2,
        "start": info.layers[2].start,
        "end": info.layers[2].end,
        "nbytes": info.layers[2].nbytes,
    }
    # ids are case-insensitive
    table = (await store.client.get(f"/api/v1/models/{MODEL_ID.upper()}/tensors")).json()
    assert table["object"] == "list"
    assert [(t["name"], t["offset"], t["nbytes"]) for t in table["data"]] == [
        (t.name, t.offset, t.nbytes) for t in info.tensors
    ]


def _needed_spans(info: GGUFInfo, first: int, last: int) -> list[tuple[int, int]]:
    """What layers first..last need, straight from gguf_info (the rule the store must follow)."""
    spans = [(0, info.data_offset)]
    spans += [(layer.start, layer.end) for layer in info.layers[first : last + 1]]
    at_end = last == info.n_layers - 1
    for t in info.tensors:
        if t.layer is not None:
            continue
        head = t.name.startswith("token_embd")
        tail = t.name.startswith(("output_norm", "output."))
        if (
            (head and (first == 0 or (at_end and info.tied_embeddings)))
            or (tail and at_end)
            or not (head or tail)
        ):
            spans.append((t.offset, t.offset + t.nbytes))
    return spans


def _check_plan(plan: PullPlan, info: GGUFInfo, first: int, last: int) -> None:
    ranges = list(plan.ranges)
    assert ranges == sorted(ranges)
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert start - end >= info.alignment  # merged unless a real gap separates them
    needed = _needed_spans(info, first, last)
    for start, end in needed:  # every needed span lies inside one range
        assert any(a <= start and end <= b for a, b in ranges), (start, end)
    # nothing more than the needed bytes and the alignment padding between them
    padding = sum(b - a for a, b in ranges) - sum(b - a for a, b in merge_ranges(needed))
    assert 0 <= padding < info.alignment * len(needed)
    assert plan.total_bytes == sum(b - a for a, b in ranges)


@pytest.mark.parametrize(
    ("model_id", "first", "last"),
    [(MODEL_ID, 0, 0), (MODEL_ID, 10, 14), (MODEL_ID, 29, 29), (TINY_ID, 1, 1), (TINY_ID, 0, 2)],
)
async def test_pull_plan_bytes_match_the_file(
    store: StoreServer, tmp_path: Path, model_id: str, first: int, last: int
) -> None:
    path = store.storage / f"{model_id}.gguf"
    info = inspect(path)
    plan = await request_pull(store.url, model_id, first, last)
    assert (plan.id, plan.size, plan.sha256) == (model_id, info.file_size, file_sha256(path))
    assert plan.file_url == f"/api/v1/models/{model_id}/file"
    _check_plan(plan, info, first, last)

    store.body.sent = 0
    sliced = await fetch_ranges(store.url, plan, tmp_path / "slice.gguf")
    assert store.body.sent == plan.total_bytes  # only the ranges crossed the wire
    original = path.read_bytes()
    fetched = sliced.read_bytes()
    assert len(fetched) == plan.size
    for start, end in plan.ranges:
        assert fetched[start:end] == original[start:end]


async def test_pull_plan_raw_json(store: StoreServer) -> None:
    r = await store.client.post(f"/api/v1/models/{TINY_ID}/pull", json={"layers": [0, 2]})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"id", "size", "sha256", "file_url", "ranges", "bytes"}
    assert all(isinstance(pair, list) and len(pair) == 2 for pair in body["ranges"])


@pytest.mark.parametrize(
    ("layers", "param"),
    [([2, 1], "layers"), ([0, 3], "layers"), ([-1, 0], "layers"), ([0], "layers")],
)
async def test_pull_rejects_bad_layers(store: StoreServer, layers: list[int], param: str) -> None:
    r = await store.client.post(f"/api/v1/models/{TINY_ID}/pull", json={"layers": layers})
    assert r.status_code == 400
    error = _error(r.json())
    assert error["type"] == "invalid_request_error"
    assert str(error["param"]).startswith(param)


async def test_unknown_model_is_404(store: StoreServer) -> None:
    for method, path in [
        ("GET", "/api/v1/models/nope/metadata"),
        ("GET", "/api/v1/models/nope/tensors"),
        ("GET", "/api/v1/models/nope/file"),
        ("POST", "/api/v1/models/nope/pull"),
    ]:
        r = await store.client.request(method, path, json={"layers": [0, 0]})
        assert r.status_code == 404, path
        error = _error(r.json())
        assert error["code"] == "model_not_found"
        assert MODEL_ID in str(error["message"]) and "registry" in str(error["message"])
    r = await store.client.get("/api/v1/nothing-here")
    assert r.status_code == 404
    assert "/api/v1/models/registry" in str(_error(r.json())["message"])


async def test_reads_need_the_api_key_when_one_is_set(
    start_store: StartStore, shared_storage: Path
) -> None:
    store = await start_store(shared_storage, api_key=READ_KEY)
    paths = [
        "/api/v1/models/registry",
        f"/api/v1/models/{TINY_ID}/metadata",
        f"/api/v1/models/{TINY_ID}/tensors",
        f"/api/v1/models/{TINY_ID}/file",
    ]
    for path in paths:
        missing = await store.client.get(path)
        assert missing.status_code == 401, path
        assert _error(missing.json())["code"] == "invalid_api_key"
        assert "Bearer" in str(_error(missing.json())["message"])
        wrong = await store.client.get(path, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        right = await store.client.get(path, headers={"Authorization": f"Bearer {READ_KEY}"})
        assert right.status_code == 200, path
    r = await store.client.post(f"/api/v1/models/{TINY_ID}/pull", json={"layers": [0, 0]})
    assert r.status_code == 401
    plan = await request_pull(store.url, TINY_ID, 0, 0, api_key=READ_KEY)
    assert plan.ranges
