"""A split model with several routers on one Redis and one PostgreSQL database.

One router runs each deployment (the one whose workers fit it: its lease in Redis); the
others know it from the database, show the running router's view, and serve requests for it
through the shared queue. Real routers, workers, ggml-rpc-servers and llama-servers, the
default model, a real Redis under a key prefix of the test's own and a schema of its own.
"""

from __future__ import annotations

import pytest
from split_models import PROMPTS, ask, deployment, rpc_servers, status

import http_calls
from cluster import MODEL, Cluster, Router, wait_until

pytestmark = pytest.mark.e2e

REDIS_URL = "redis://127.0.0.1:6379/0"


def served(router: Router) -> list[str]:
    r = http_calls.get(router.url + "/v1/models", headers=router.headers, timeout=5)
    return [m["id"] for m in r.json()["data"]]


def test_a_split_deployed_through_one_router_runs_on_the_router_with_the_workers(
    cluster: Cluster, redis_prefix: str, pg_url: str
) -> None:
    shared = ("--redis-url", REDIS_URL, "--redis-prefix", redis_prefix, "--database-url", pg_url)
    a = cluster.router(*shared)
    b = cluster.router(*shared)
    workers = {
        name: cluster.worker(a, "--slots", "1", "--ctx-size", "1024", name=name)
        for name in ("on-a-1", "on-a-2")
    }
    a.wait_workers(2)
    router_a = a.workers()[0]["router"]

    # Deployed through B, which has no workers: A, whose workers fit it, takes it.
    body = {"model": str(cluster.model_path), "name": "smol-split", "ctx": 1024}
    r = http_calls.post(b.url + "/api/v1/pipeline/deploy", json=body, headers=b.headers, timeout=30)
    assert r.status_code == 202, r.text
    on_b = wait_until(
        lambda: (d := deployment(b, "smol-split"))["state"] == "serving" and d,
        120,
        "router B to show the split serving",
    )
    assert on_b["router"] == router_a
    assert [s["worker_name"] for s in on_b["shards"]] == ["on-a-1", "on-a-2"]
    assert deployment(a, "smol-split")["router"] == router_a
    assert len(rpc_servers(workers["on-a-2"].pid)) == 1  # one stage, started once

    # Either router serves the model, with the same greedy answers as one machine.
    for prompt in PROMPTS[:2]:
        expected = ask(a, MODEL, prompt)
        assert ask(b, "smol-split", prompt) == expected, prompt
        assert ask(a, "smol-split", prompt) == expected, prompt

    # Undeployed through B: A stops the shards and neither router lists it.
    r = http_calls.post(b.url + "/api/v1/pipeline/undeploy", json={"name": "smol-split"})
    assert r.status_code == 200, r.text
    wait_until(lambda: not rpc_servers(workers["on-a-2"].pid), 30, "A to stop the stage")
    wait_until(lambda: status(a) == [] and status(b) == [], 10, "both routers to forget it")
    wait_until(
        lambda: all("smol-split" not in served(r) for r in (a, b)),
        10,
        "the head worker to stop advertising it",
    )
    r = http_calls.post(
        b.url + "/v1/chat/completions",
        json={"model": "smol-split", "messages": [{"role": "user", "content": "hi"}]},
        headers=b.headers,
    )
    assert r.status_code == 404, r.text


def test_status_on_a_router_without_the_workers_says_who_could_run_it(
    cluster: Cluster, redis_prefix: str, pg_url: str
) -> None:
    shared = ("--redis-url", REDIS_URL, "--redis-prefix", redis_prefix, "--database-url", pg_url)
    b: Router = cluster.router(*shared)
    body = {"model": str(cluster.model_path), "name": "smol-split", "ctx": 1024}
    r = http_calls.post(b.url + "/api/v1/pipeline/deploy", json=body, headers=b.headers, timeout=30)
    assert r.status_code == 202, r.text
    view = wait_until(lambda: status(b) or None, 10, "the deployment to be listed")[0]
    assert view["state"] == "pending" and view["router"] is None
    assert "waiting for a router whose workers can hold it" in view["detail"]
    r = http_calls.post(
        b.url + "/v1/chat/completions",
        json={"model": "smol-split", "messages": [{"role": "user", "content": "hi"}]},
        headers=b.headers,
    )
    assert r.status_code == 503 and int(r.headers["retry-after"]) > 0, r.text
    assert "split over several workers" in r.json()["error"]["message"]
