"""Pull-mode workers (``shoal worker --redis-url``): routers on Redis, no WebSocket worker.

Real router, pull worker and llama-server processes and the real Redis (127.0.0.1:6379);
every test uses its own key prefix (``redis_prefix``), deleted afterwards.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
import redis

import http_calls
from cluster import API_KEY, MODEL, Cluster, Router, wait_until

pytestmark = pytest.mark.e2e

REDIS_URL = "redis://127.0.0.1:6379/0"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LEASE = ("--queue-lease", "6")
"""The routers' lease in these tests (twice their heartbeat timeout of 3 s)."""


def shared_router(cluster: Cluster, prefix: str, *args: str) -> Router:
    return cluster.router("--redis-url", REDIS_URL, "--redis-prefix", prefix, *args)


def job_hash(client: redis.Redis, prefix: str, job_id: str) -> dict[str, str]:
    raw = client.hgetall(f"{prefix}job:{job_id}")
    return {k.decode(): v.decode() for k, v in raw.items() if k != b"body"}


def running_jobs(client: redis.Redis, prefix: str) -> list[dict[str, str]]:
    """Jobs in state running under the prefix (a SCAN: tests only)."""
    found = []
    for key in client.scan_iter(match=f"{prefix}job:*", count=500):
        if not key.endswith(b":out"):
            job = job_hash(client, prefix, key.decode().rsplit(":", 1)[1])
            if job.get("state") == "running":
                found.append(job)
    return found


def test_router_with_only_a_pull_worker_serves_the_openai_client(
    cluster: Cluster,
    redis_prefix: str,
    cache_dir: Path,
    make_client: Callable[..., openai.OpenAI],
) -> None:
    router = shared_router(cluster, redis_prefix)
    # No --model: a pull worker serves Shoal's default model (here from the shared cache).
    worker = cluster.pull_worker(
        REDIS_URL,
        redis_prefix,
        *LEASE,
        "--cache-dir",
        str(cache_dir),
        "--offline",
        name="puller",
        model=False,
    )
    [listed] = router.wait_workers(1)
    assert listed["name"] == "puller" and listed["router"] == "pull"
    assert listed["connection"] == "redis-pull"
    assert [m["name"] for m in listed["models"]] == [MODEL]
    models = http_calls.get(router.url + "/v1/models", headers=AUTH, timeout=5).json()["data"]
    assert [(m["id"], m["workers"], m["state"]) for m in models] == [(MODEL, 1, "ready")]
    assert http_calls.get(router.url + "/health", timeout=5).json()["status"] == "ok"

    client = make_client(router.url)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "Say hi"}
    ]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=5
    )
    whole = raw.parse()
    assert whole.choices[0].message.content and whole.model == MODEL
    rclient = redis.Redis(host="127.0.0.1", port=6379)
    try:
        ran = job_hash(rclient, redis_prefix, raw.headers["x-request-id"])
    finally:
        rclient.close()
    assert ran["owner"].startswith("worker-puller-") and ran["state"] == "succeeded"
    assert raw.headers["x-shoal-worker"] == listed["id"]  # the router names the pull worker

    with client.chat.completions.with_streaming_response.create(
        model=MODEL, messages=messages, max_tokens=5, stream=True
    ) as streamed:
        assert streamed.headers["x-shoal-worker"] == listed["id"]
        pieces = [c.choices[0].delta.content or "" for c in streamed.parse() if c.choices]
    assert "".join(pieces)

    # A clean stop takes the worker off every router's list at once (not after its TTL).
    assert worker.stop() == 0
    wait_until(lambda: router.workers() == [], 5, "the stopped pull worker to leave the list")


def test_job_of_a_killed_pull_worker_runs_again_on_another(
    cluster: Cluster, redis_prefix: str
) -> None:
    """A pull worker dies holding a job with no output yet (not streamed: nothing reaches
    Redis before the whole answer): the sweep puts it back and a second pull worker runs it."""
    router = shared_router(cluster, redis_prefix, "--max-wait", "60")
    doomed = cluster.pull_worker(REDIS_URL, redis_prefix, *LEASE, "--slots", "1", name="doomed")
    router.wait_workers(1)
    long_prompt = "Summarise this text. " + "The quick brown fox jumps over the lazy dog. " * 80
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": long_prompt}],
    }
    answer: dict[str, object] = {}

    def ask() -> None:
        r = http_calls.post(
            router.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120
        )
        answer["status"] = r.status_code
        answer["id"] = r.headers.get("x-request-id")
        answer["body"] = r.json() if r.status_code == 200 else r.text

    rclient = redis.Redis(host="127.0.0.1", port=6379)
    client = threading.Thread(target=ask)
    try:
        client.start()
        [held] = wait_until(
            lambda: running_jobs(rclient, redis_prefix), 30, "the pull worker to take the job"
        )
        assert held["owner"].startswith("worker-doomed-") and held.get("started", "0") == "0", held
        os.kill(doomed.pid, signal.SIGKILL)
        cluster.pull_worker(REDIS_URL, redis_prefix, *LEASE, name="rescuer")
        client.join(90)
        assert answer.get("status") == 200, f"{answer}\n{cluster.logs()}"
        assert isinstance(answer["body"], dict) and answer["body"]["choices"][0]["message"]
        job_id = str(answer["id"])
        ran = job_hash(rclient, redis_prefix, job_id)
    finally:
        client.join(1)
        rclient.close()
    assert ran["owner"].startswith("worker-rescuer-") and ran["attempt"] == "2", ran
    assert ran["state"] == "succeeded"
