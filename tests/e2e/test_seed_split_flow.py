"""The seed's whole split-model flow (issue 29's "done means") in one cluster of real processes.

``shoal data`` over TLS on the cluster's key database refuses an upload without a key (401);
``shoal data upload`` with an admin key stores the default model under an id no catalog knows.
A router given that store (``--model-store``, ``--model-store-ca``, a worker key to read it)
and a fresh cache deploys it by the store id over three workers (each offering split models
200 MiB, ``--shard-ram``; each also serves the default model whole, the one-machine reference):
greedy answers equal one machine's, and the router keeps no copy. Status shows each stage's
link: the RPC round trip as the head timed it (``rtt_ms``) and bytes both ways. A fourth
worker offering 1000 MiB joins while a long stream runs: the plan over four is better (the
fullest worker drops from 70 % to 59 %), the deployment drains, the stream completes whole,
and it serves over four.
"""

from __future__ import annotations

import ssl
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from threading import Event

import pytest
from split_models import PROMPTS, ask, deployment, head_timed, long_stream

import http_calls
from certs import make_certs
from cluster import MODEL, Cluster, Router, upload_cli, wait_until
from shoal.pip_download import file_sha256

pytestmark = pytest.mark.e2e

STORE_ID = "smol-seed-flow"
NAME = "smol-seed"
SMALL = str(200 / 1024)  # GiB: 200 MiB
BIG = str(1000 / 1024)
WORKER_ARGS = ("--slots", "1", "--ctx-size", "1024")


def assert_links_measured(router: Router) -> None:
    """Each stage's link in status: RPC round trips as the head timed them (and as the
    router's tunnel hub saw them) and bytes both ways (the head has no link of its own)."""
    head, *stages = head_timed(router, NAME)
    assert head["link"] is None
    for stage in stages:
        link = stage["link"]
        assert link["measured"] and link["connections"] >= 1, link
        assert link["bytes_to_stage"] > 0 and link["bytes_to_head"] > 0, link
        assert link["rtt_ms"]["samples"] > 0 and link["rtt_ms"]["median"] > 0, link
        assert link["rtt_measures"].startswith("the head:"), link
        assert link["router_rtt_ms"]["samples"] > 0 and link["router_rtt_ms"]["median"] > 0


def test_upload_deploy_by_store_id_and_rebalance_on_join(
    cluster: Cluster, model_path: Path, tmp_path: Path
) -> None:
    # 1. The store over TLS with keys: no key, no upload.
    certs = make_certs(tmp_path / "certs")
    admin, worker_key = cluster.key("admin"), cluster.key("worker")
    _, store = cluster.tls_store(certs, tmp_path / "store")
    trusting = ssl.create_default_context(cafile=certs.ca)
    sha = file_sha256(model_path)
    anonymous = http_calls.post(
        f"{store}/api/v1/storage/upload?id={STORE_ID}&sha256={sha}",
        content=b"GGUF",
        verify=trusting,
    )
    assert anonymous.status_code == 401, anonymous.text
    assert anonymous.json()["error"]["code"] == "invalid_api_key"

    # 2. The default model uploaded under a new id with the CLI, as an admin.
    size = model_path.stat().st_size
    done = upload_cli(store, model_path, admin, certs.ca, "--id", STORE_ID)
    assert done.returncode == 0, done.stderr
    assert f"stored {STORE_ID}: {size} bytes, sha256 {sha} (verified" in done.stdout

    # 3. Deployed by the store id over three workers; the router keeps no copy.
    router_cache = tmp_path / "router-cache"
    router = cluster.router(
        *("--model-store", store, "--model-store-ca", str(certs.ca)),
        *("--model-store-key", worker_key, "--cache-dir", str(router_cache)),
        *("--rebalance-quiet-s", "1"),
        api_key=admin,  # the key database has an admin key now: the control plane needs one
    )
    worker_args = (
        *WORKER_ARGS,
        *("--tls-ca", str(certs.ca)),  # the store's CA; the router stays on ws://
        *("--router-url", f"ws://127.0.0.1:{router.port}"),
    )
    for name in ("s1", "s2", "s3"):
        cluster.worker(router, *worker_args, "--shard-ram", SMALL, name=name, gpu_key=worker_key)
    router.wait_workers(3)
    body = {"model": STORE_ID, "name": NAME, "ctx": 2048}  # any workers: a joiner may help
    r = http_calls.post(
        router.url + "/api/v1/pipeline/deploy", json=body, headers=router.headers, timeout=60
    )
    assert r.status_code == 202, r.text
    served = wait_until(
        lambda: (d := deployment(router, NAME))["state"] == "serving" and d,
        180,
        "the split model to serve over three workers",
    )
    assert served["store"] == {"url": store, "id": STORE_ID, "sha256": sha, "size": size}
    assert [s["worker_name"] for s in served["shards"]] == ["s1", "s2", "s3"]
    assert [s["layers"] for s in served["shards"]] == [[0, 9], [10, 19], [20, 29]]
    one_machine = [ask(router, MODEL, p) for p in PROMPTS]
    assert [ask(router, NAME, p) for p in PROMPTS] == one_machine
    fetched = cluster.base / "cache" / "models" / "store" / f"{STORE_ID}.gguf"
    assert file_sha256(fetched) == sha  # the head's copy, from the store over TLS
    assert [p for p in router_cache.rglob("*") if STORE_ID in p.name] == []

    # 5. Status: each stage's round trip and bytes.
    assert_links_measured(router)

    # 4. A fourth worker that makes the plan better joins while a stream runs.
    first = Event()
    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(long_stream, router, NAME, first)
        assert first.wait(60), "the stream never started"
        cluster.worker(router, *worker_args, "--shard-ram", BIG, name="s4", gpu_key=worker_key)
        draining = wait_until(
            lambda: (d := deployment(router, NAME))["state"] == "draining" and d,
            120,
            "the deployment to drain for the rebalance",
        )
        assert "from 70% to 59%" in draining["detail"], draining["detail"]
        assert not streaming.done(), "the stream ended before the rebalance began"
        text, finish, chunks = streaming.result(600)
    assert finish == "length" and chunks >= 1000 and text, (finish, chunks)

    moved = wait_until(
        lambda: (d := deployment(router, NAME))["state"] == "serving" and d,
        180,
        "the split model to serve over four workers",
    )
    assert [s["worker_name"] for s in moved["shards"]] == ["s1", "s2", "s3", "s4"]
    assert [s["layers"] for s in moved["shards"]] == [[0, 3], [4, 7], [8, 11], [12, 29]]
    assert ask(router, NAME, PROMPTS[0]) == one_machine[0]
    assert_links_measured(router)
