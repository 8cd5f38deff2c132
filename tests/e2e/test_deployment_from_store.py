"""A split model deployed by its model-store id: the router has no copy, the workers fetch it.

Real processes: ``shoal data`` holding the default model under an id no catalog knows, a router
given that store (after one that is down) and a fresh cache, three real workers (each also
serving the default model on its own, the one-machine reference). The router plans from the
store's header, the head fetches the whole file from the store (sha256 checked), the stages
their layers; greedy answers equal one machine's. A model the store that answered lacks, with
the other store down, is a 503 naming both, and leaves no deployment behind. The same
deployment from the router's own store (``--storage``), which workers reach at the router's
URL.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from split_models import PROMPTS, ask, deployment, status

import http_calls
from cluster import MODEL, Cluster, Proc, Router, clean_env, free_port, wait_until
from shoal.pip_download import file_sha256

pytestmark = pytest.mark.e2e

STORE_ID = "smol-in-store"
NAME = "smol-stored"


@pytest.fixture
def data_store(model_path: Path, tmp_path: Path) -> Iterator[str]:
    """`shoal data` over a folder holding the default model as ``STORE_ID``; its URL."""
    folder = tmp_path / "store"
    folder.mkdir()
    try:
        os.link(model_path, folder / f"{STORE_ID}.gguf")
    except OSError:  # another file system: a copy serves as well
        (folder / f"{STORE_ID}.gguf").write_bytes(model_path.read_bytes())
    port = free_port()
    argv = [sys.executable, "-m", "shoal", "data", "--storage", str(folder), "--port", str(port)]
    proc = Proc("data", argv, tmp_path / "data.log", clean_env()).start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_calls.get(base + "/api/v1/models/registry").is_success, 30, "store")
        yield base
    finally:
        proc.stop()


def _post(router: Router, path: str, body: dict[str, object]) -> httpx.Response:
    return http_calls.post(router.url + path, json=body, headers=router.headers, timeout=60)


def test_deploy_by_store_id_with_no_copy_on_the_router(
    cluster: Cluster, data_store: str, model_path: Path, tmp_path: Path
) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    router_cache = tmp_path / "router-cache"
    router = cluster.router(
        "--model-store", f"{down},{data_store}", "--cache-dir", str(router_cache)
    )
    names = ["w1", "w2", "w3"]
    for name in names:
        cluster.worker(router, "--slots", "1", "--ctx-size", "1024", name=name)
    router.wait_workers(3)

    planned = _post(router, "/api/v1/pipeline/plan", {"model": STORE_ID, "workers": names})
    assert planned.status_code == 200, planned.text
    plan = planned.json()
    assert plan["fits"] and plan["n_layers"] == 30
    assert plan["store"] == {
        "url": data_store,
        "id": STORE_ID,
        "sha256": file_sha256(model_path),
        "size": model_path.stat().st_size,
    }

    # Not in the store that answered, and the other could not be asked: it may be there.
    missing = _post(router, "/api/v1/pipeline/deploy", {"model": "no-such-model", "name": "x"})
    assert missing.status_code == 503, missing.text
    error = missing.json()["error"]
    assert error["code"] == "model_store_unavailable"
    assert down in error["message"] and data_store in error["message"]
    assert status(router) == []  # nothing half-deployed

    body = {"model": STORE_ID, "name": NAME, "workers": names, "ctx": 2048}
    r = _post(router, "/api/v1/pipeline/deploy", {**body, "strategy": "balanced"})
    assert r.status_code == 202, r.text
    served = wait_until(
        lambda: (d := deployment(router, NAME))["state"] == "serving" and d,
        180,
        "the split model to serve",
    )
    assert served["store"] == plan["store"]
    shards = served["shards"]
    assert isinstance(shards, list)
    assert [s["layers"] for s in shards] == [[0, 9], [10, 19], [20, 29]]

    answers = [ask(router, NAME, p) for p in PROMPTS]
    assert answers == [ask(router, MODEL, p) for p in PROMPTS]

    fetched = cluster.base / "cache" / "models" / "store" / f"{STORE_ID}.gguf"
    assert file_sha256(fetched) == file_sha256(model_path)  # the head's copy, from the store
    on_router = [p for p in router_cache.rglob("*") if STORE_ID in p.name]
    assert on_router == []  # the router read the header and kept nothing


def test_deploy_from_the_routers_own_store(
    cluster: Cluster, model_path: Path, tmp_path: Path
) -> None:
    """``--storage``: the store is the router's own; workers fetch from it at the router's
    URL, with their GPU key."""
    storage = tmp_path / "storage"
    storage.mkdir()
    os.link(model_path, storage / f"{STORE_ID}.gguf")
    router = cluster.router(
        "--storage", str(storage), "--cache-dir", str(tmp_path / "router-cache")
    )
    names = ["w1", "w2"]
    for name in names:
        cluster.worker(router, "--slots", "1", "--ctx-size", "1024", name=name)
    router.wait_workers(2)
    body = {"model": STORE_ID, "name": NAME, "workers": names, "ctx": 2048}
    r = _post(router, "/api/v1/pipeline/deploy", body)
    assert r.status_code == 202, r.text
    served = wait_until(
        lambda: (d := deployment(router, NAME))["state"] == "serving" and d,
        180,
        "the split model to serve",
    )
    store = served["store"]
    assert isinstance(store, dict) and store["url"] is None and store["id"] == STORE_ID
    prompts = PROMPTS[:2]
    assert [ask(router, NAME, p) for p in prompts] == [ask(router, MODEL, p) for p in prompts]
