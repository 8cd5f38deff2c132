"""The dry-run plan: the real model's layers over real workers' free memory."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

import http_calls
from cluster import MODEL, Cluster, clean_env

pytestmark = pytest.mark.e2e


def test_plan_over_two_workers_and_its_errors(cluster: Cluster) -> None:
    router = cluster.router()
    cluster.worker(router, "--slots", "1", name="a")
    cluster.worker(router, "--slots", "1", name="b")
    workers = router.wait_workers(2)
    ids = sorted(w["id"] for w in workers)

    def post(**body: object) -> httpx.Response:
        return http_calls.post(
            router.url + "/api/v1/pipeline/plan", json=body, headers=router.headers, timeout=30
        )

    r = post(model=MODEL, ctx=4000)
    assert r.status_code == 200, r.text
    p = r.json()
    assert p["fits"] is True and p["n_layers"] == 30 and p["ctx"] == 4096  # padded to 256
    shards = p["shards"]
    assert [s["worker"] for s in shards] == ids and p["head_worker"] == ids[0]
    assert [s["role"] for s in shards] == ["head", "tail"]
    assert shards[0]["layers"][0] == 0 and shards[-1]["layers"][1] == 29
    assert shards[0]["layers"][1] + 1 == shards[1]["layers"][0]  # contiguous, in order
    assert sum(s["n_layers"] for s in shards) == 30
    assert sum(p["tensor_split"]) == 31  # the output layer counts as one more on the last
    assert all(s["margin_bytes"] > 0 for s in shards)
    # No GPU here: every layer on a CPU; the head's stay behind -ngl, the stage's go to RPC0.
    head_layers = shards[0]["n_layers"]
    assert [[d["device"] for d in s["devices"]] for s in shards] == [["CPU"], ["CPU"]]
    assert p["head"] == {
        "n_gpu_layers": 31 - head_layers, "devices": ["RPC0"], "tensor_split": [31 - head_layers],
    }  # fmt: skip
    assert p["stage_devices"] == [["CPU"]] and p["refused"] is None
    assert p["layout"] == [
        f"a/CPU layers 0-{head_layers - 1} + token embedding",
        f"b/CPU layers {head_layers}-29",
    ]

    one = post(model=MODEL, workers=[ids[1]], strategy="balanced").json()
    assert [s["role"] for s in one["shards"]] == ["head"]
    assert one["shards"][0]["layers"] == [0, 29]

    too_big = post(model=MODEL, ctx=16_000_000).json()
    assert too_big["fits"] is False and too_big["shortfall_bytes"] > 0
    assert "GiB" in too_big["reason"]

    assert post(model=MODEL, workers=["nobody"]).status_code == 400
    assert post(model="no-such-model").status_code == 404
    bad = post(model=MODEL, ctx=0)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert post(model=MODEL, surprise=1).status_code == 400


def test_models_inspect_command(model_path: object) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal",
            "models",
            "inspect",
            str(model_path),
            "--json",
            "--log-level",
            "warning",
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        check=True,
        timeout=60,
    ).stdout
    import json

    info = json.loads(out)
    assert info["architecture"] == "llama" and info["n_layers"] == 30
    assert len(info["layers"]) == 30
