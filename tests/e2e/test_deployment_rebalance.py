"""A worker that joins a serving split model and makes its plan better moves it, mid-stream.

Real router and workers, the real default model split over two workers that offer split
models 200 MiB of RAM each (``--shard-ram``): the fullest holds 79 % of it. A third worker
that offers 1000 MiB joins while a long stream runs; after the quiet period the router judges
the plan over three workers better (the fullest drops to 59 %), drains (the stream goes on to
its end, new requests get a 503), then switches: the deployment serves over three workers,
with the same greedy answers as one machine. Status shows each stage's link (bytes both ways
and the RPC turnaround as the head timed it, and as the router's tunnel hub saw it), and
``POST …/rebalance`` with nothing better to do answers 200 and leaves it serving.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from threading import Event

import pytest
from split_models import PROMPTS, ask, deployment, head_timed, long_stream

import http_calls
from cluster import MODEL, Cluster, wait_until

pytestmark = pytest.mark.e2e

SMALL = str(200 / 1024)  # GiB: 200 MiB
BIG = str(1000 / 1024)
WORKER_ARGS = ("--slots", "1", "--ctx-size", "1024")


def test_a_joining_worker_rebalances_the_split_while_a_stream_runs(cluster: Cluster) -> None:
    router = cluster.router("--rebalance-quiet-s", "1")
    for name in ("r1", "r2"):
        cluster.worker(router, *WORKER_ARGS, "--shard-ram", SMALL, name=name)
    router.wait_workers(2)
    body = {"model": str(cluster.model_path), "name": "smol-split", "ctx": 2048}  # relayed
    r = http_calls.post(
        router.url + "/api/v1/pipeline/deploy", json=body, headers=router.headers, timeout=60
    )
    assert r.status_code == 202, r.text
    served = wait_until(
        lambda: (d := deployment(router, "smol-split"))["state"] == "serving" and d,
        120,
        "the split model to serve over two workers",
    )
    assert [s["worker_name"] for s in served["shards"]] == ["r1", "r2"]
    assert [s["layers"] for s in served["shards"]] == [[0, 14], [15, 29]]
    one_machine = [ask(router, MODEL, p) for p in PROMPTS]
    assert [ask(router, "smol-split", p) for p in PROMPTS] == one_machine

    # Status: each stage's link, its RPC round trips as the head timed them (reported every
    # few seconds while it serves) and as the router's tunnel hub saw them.
    head, stage = head_timed(router, "smol-split")
    assert head["link"] is None
    link = stage["link"]
    assert link["measured"] and link["connections"] >= 1, link
    assert link["bytes_to_stage"] > 0 and link["bytes_to_head"] > 0, link
    assert link["rtt_ms"]["samples"] > 0 and link["rtt_ms"]["median"] > 0, link
    assert link["rtt_measures"].startswith("the head:"), link
    assert link["router_rtt_ms"]["samples"] > 0 and link["router_rtt_ms"]["median"] > 0, link

    first = Event()
    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(long_stream, router, "smol-split", first)
        assert first.wait(60), "the stream never started"
        cluster.worker(router, *WORKER_ARGS, "--shard-ram", BIG, name="r3")
        draining = wait_until(
            lambda: (d := deployment(router, "smol-split"))["state"] == "draining" and d,
            120,
            "the deployment to drain for the rebalance",
        )
        assert "from 79% to 59%" in draining["detail"], draining["detail"]
        assert not streaming.done(), "the stream ended before the rebalance began"
        refused = http_calls.post(
            router.url + "/v1/chat/completions",
            json={"model": "smol-split", "messages": [{"role": "user", "content": "Hi"}]},
            headers=router.headers,
            timeout=30,
        )
        assert refused.status_code == 503 and "Retry-After" in refused.headers, refused.text
        text, finish, chunks = streaming.result(600)
    assert finish == "length" and chunks >= 1000 and text, (finish, chunks)

    moved = wait_until(
        lambda: (d := deployment(router, "smol-split"))["state"] == "serving" and d,
        180,
        "the split model to serve over three workers",
    )
    assert [s["worker_name"] for s in moved["shards"]] == ["r1", "r2", "r3"]
    assert [s["layers"] for s in moved["shards"]] == [[0, 3], [4, 7], [8, 29]]
    assert [ask(router, "smol-split", p) for p in PROMPTS] == one_machine
    links = [s["link"] for s in head_timed(router, "smol-split")[1:]]
    assert all(link["measured"] and link["rtt_ms"]["samples"] > 0 for link in links), links
    assert all(link["rtt_ms"]["median"] > 0 for link in links), links

    # Asked for a rebalance with nothing better to do: 200, and it keeps serving as it is.
    r = http_calls.post(
        router.url + "/api/v1/pipeline/rebalance",
        json={"name": "smol-split"},
        headers=router.headers,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    [after] = r.json()["data"]
    assert after["state"] == "serving" and len(after["shards"]) == 3
