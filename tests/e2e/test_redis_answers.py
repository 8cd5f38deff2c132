"""What a client of any router on one Redis is told, as on a lone router: which worker
answered (``x-shoal-worker``, streamed or not, whichever router's worker it was) and which
models exist when it asks for one that does not.

Real router, worker and llama-server processes and a real Redis (127.0.0.1:6379); the test
uses its own key prefix (``redis_prefix``), deleted afterwards.
"""

from __future__ import annotations

import pytest

import http_calls
from cluster import API_KEY, MODEL, Cluster, Router, iter_sse, wait_until

pytestmark = pytest.mark.e2e

REDIS_URL = "redis://127.0.0.1:6379/0"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ASK = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Say hi"}]}


def shared_router(cluster: Cluster, prefix: str) -> Router:
    return cluster.router("--redis-url", REDIS_URL, "--redis-prefix", prefix)


def answered_by(router: Router, *, stream: bool) -> tuple[str | None, str]:
    """The ``x-shoal-worker`` header of one answer (None if missing), and the job id."""
    with http_calls.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json={**ASK, "stream": stream},
        headers=AUTH,
        timeout=60,
    ) as r:
        assert r.status_code == 200, r.read()
        if stream:
            assert list(iter_sse(r))[-1] == "[DONE]"
        else:
            assert r.read() and r.json()["choices"][0]["message"]["content"]
        return r.headers.get("x-shoal-worker"), r.headers["x-request-id"]


def test_every_answer_names_its_worker_and_a_404_lists_the_clusters_models(
    cluster: Cluster, redis_prefix: str
) -> None:
    a = shared_router(cluster, redis_prefix)
    b = shared_router(cluster, redis_prefix)  # no worker of its own
    cluster.worker(a, name="on-a")
    [on_a] = a.wait_workers(1)
    wait_until(lambda: b.workers() or None, 10, "router B to list A's worker")

    # The router whose own worker answered, and the one that only relayed the answer.
    for router in (a, b):
        for stream in (False, True):
            worker, job_id = answered_by(router, stream=stream)
            assert worker == on_a["id"], (router.url, stream, job_id)

    # B has no worker of its own: its 404 still names the model A's worker serves.
    r = http_calls.post(b.url + "/v1/chat/completions", json={**ASK, "model": "nope"}, headers=AUTH)
    assert r.status_code == 404
    assert f"Available: {MODEL}." in r.json()["error"]["message"], r.text
