"""The async jobs API and the result cache through a real router, worker and llama-server."""

from __future__ import annotations

from typing import Any

import pytest

import http_calls
from cluster import MODEL, Cluster, Router, wait_until

pytestmark = pytest.mark.e2e

ASK = {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": "Say hi"}]}


def _job(router: Router, job_id: str) -> dict[str, Any]:
    r = http_calls.get(f"{router.url}/v1/jobs/{job_id}", headers=router.headers, timeout=10)
    r.raise_for_status()
    job: dict[str, Any] = r.json()
    return job


def test_async_job_lifecycle_with_records_shared_through_redis(
    cluster: Cluster, redis_prefix: str
) -> None:
    shared = ("--redis-url", "redis://127.0.0.1:6379/0", "--redis-prefix", redis_prefix)
    a = cluster.router(*shared)
    b = cluster.router(*shared)
    cluster.worker(a)
    a.wait_workers(1)
    posted = http_calls.post(
        a.url + "/v1/jobs", json={"type": "chat_completion", **ASK}, headers=a.headers
    )
    assert posted.status_code == 202, posted.text
    job_id = posted.json()["id"]
    assert posted.headers["location"].endswith(f"/v1/jobs/{job_id}")
    done = wait_until(
        lambda: (j := _job(a, job_id))["status"] == "succeeded" and j, 60, "the job to finish"
    )
    assert done["result"]["choices"][0]["message"]["content"] and done["error"] is None
    # The other router sees the same record (it lives in Redis).
    assert _job(b, job_id)["status"] == "succeeded"
    # A finished job cannot be cancelled; unknown ids and bad types are clear errors.
    gone = http_calls.delete(f"{b.url}/v1/jobs/{job_id}", headers=b.headers)
    assert gone.status_code == 409
    assert http_calls.get(f"{a.url}/v1/jobs/job_nope", headers=a.headers).status_code == 404
    bad = http_calls.post(a.url + "/v1/jobs", json={"type": "painting", **ASK}, headers=a.headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "type"
    # A model no worker serves is refused at submit, as the request itself is (it was
    # accepted with 202, and failed later).
    unknown = {"type": "chat_completion", **ASK, "model": "no-such-model"}
    for router in (a, b):
        refused = http_calls.post(router.url + "/v1/jobs", json=unknown, headers=router.headers)
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["code"] == "model_not_found"
        assert MODEL in refused.json()["error"]["message"]  # what is served instead


def test_cancelling_queued_and_running_jobs(cluster: Cluster) -> None:
    router = cluster.router()
    cluster.worker(router, "--slots", "1")
    router.wait_workers(1)
    long = {"type": "completion", "model": MODEL, "prompt": "Once", "max_tokens": 400}
    posts = [
        http_calls.post(
            router.url + "/v1/jobs", json={**long, "ignore_eos": True}, headers=router.headers
        ).json()
        for _ in range(2)
    ]
    running, queued = (post["id"] for post in posts)
    # The 202 says where each stands: the first took the slot, the second waits, first in line
    # (its queue_position was null in the 202 and filled in a moment later).
    assert posts[0]["status"] == "running", posts
    assert posts[1]["status"] == "queued" and posts[1]["queue_position"] == 0, posts
    wait_until(lambda: _job(router, running)["status"] == "running", 30, "the first job to run")
    assert _job(router, queued)["status"] == "queued"  # the worker's one slot is taken
    for job_id in (queued, running):
        cancelled = http_calls.delete(f"{router.url}/v1/jobs/{job_id}", headers=router.headers)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert _job(router, job_id)["status"] == "cancelled"
    # The slot is free again: llama-server stopped generating for the cancelled job.
    after = http_calls.post(router.url + "/v1/chat/completions", json=ASK, headers=router.headers)
    assert after.status_code == 200


def test_deterministic_requests_are_answered_from_the_cache(cluster: Cluster) -> None:
    router = cluster.router("--cache")
    cluster.worker(router)
    router.wait_workers(1)
    greedy = {**ASK, "temperature": 0}
    url = router.url + "/v1/chat/completions"
    first = http_calls.post(url, json=greedy, headers=router.headers, timeout=60)
    again = http_calls.post(url, json=greedy, headers=router.headers, timeout=60)
    assert first.headers["x-shoal-cache"] == "miss" and again.headers["x-shoal-cache"] == "hit"
    assert again.json()["choices"] == first.json()["choices"]
    assert "x-shoal-worker" not in again.headers  # no worker was asked

    streamed = [_sse(router, {**greedy, "stream": True}) for _ in range(2)]
    assert [s[0] for s in streamed] == ["miss", "hit"]
    assert streamed[0][1] == streamed[1][1] and streamed[1][1].endswith("data: [DONE]\n\n")

    sampled = http_calls.post(
        url, json={**ASK, "temperature": 0.8}, headers=router.headers, timeout=60
    )
    assert "x-shoal-cache" not in sampled.headers  # not deterministic: never cached
    fresh = http_calls.post(
        url, json=greedy, headers={**router.headers, "Cache-Control": "no-cache"}, timeout=60
    )
    assert fresh.headers["x-shoal-cache"] == "miss"


def _sse(router: Router, body: dict[str, Any]) -> tuple[str, str]:
    with http_calls.stream(
        "POST", router.url + "/v1/chat/completions", json=body, headers=router.headers, timeout=60
    ) as r:
        text = "".join(r.iter_text())
        return r.headers["x-shoal-cache"], text
