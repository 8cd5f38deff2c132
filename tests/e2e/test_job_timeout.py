"""``--job-timeout``: a request still unanswered that long after it arrived fails with a 504
``job_timeout`` error naming the limit and the setting (a started stream ends with it as its
error event, without ``[DONE]``), whether it waited for a worker, ran, or both, and its worker
stops generating; an async job fails the same way. Real router, worker and llama-server."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import http_calls
from cluster import MODEL, Cluster, Router, iter_sse, wait_until

pytestmark = pytest.mark.e2e

LIMIT_S = 5.0
SLACK_S = 3.0
"""How late past the limit the error may come on a busy machine."""
LONG: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell a long story about a lighthouse keeper."}],
    "max_tokens": 2000,  # tens of seconds on one thread: far past the limit
    "ignore_eos": True,
}
MESSAGE = f"limit of {LIMIT_S:g} s (its --job-timeout)"


def stream(router: Router) -> tuple[int, dict[str, Any], bool, float]:
    """Stream ``LONG``: content chunks, the error event, whether [DONE] came, seconds taken."""
    started = time.monotonic()
    content, error, done = 0, {}, False
    body = {**LONG, "stream": True}
    with http_calls.stream(
        "POST", router.url + "/v1/chat/completions", json=body, headers=router.headers, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        for data in iter_sse(r):
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                continue
            content += any(c["delta"].get("content") for c in chunk["choices"])
    return content, error, done, time.monotonic() - started


def generating(router: Router) -> bool:
    """Whether the (one) worker's llama-server is working on a request."""
    [worker] = router.workers()
    slots = http_calls.get(worker["backend_url"] + "/slots", timeout=5).json()
    return any(s["is_processing"] for s in slots)


def test_requests_past_the_job_timeout_fail_and_their_worker_stops(cluster: Cluster) -> None:
    router = cluster.router("--job-timeout", f"{LIMIT_S:g}")
    worker = cluster.worker(router, "--slots", "1")
    router.wait_workers(1)
    # A new llama-server's slot first measures the prompt speed (seconds on a busy machine).
    wait_until(lambda: "prompt speed:" in worker.log(), 60, "the prompt speed measured")
    url = router.url + "/v1/chat/completions"
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(stream, router)
        wait_until(lambda: generating(router), 30, "the stream to run")
        # The worker's one slot is taken: this one waits, then runs, and times out too.
        t0 = time.monotonic()
        whole = http_calls.post(url, json=LONG, headers=router.headers, timeout=60)
        waited = time.monotonic() - t0
        content, error, done, took = streamed.result()

    assert content > 0 and not done, "the stream had started, and ended without [DONE]"
    assert error["code"] == "job_timeout" and MESSAGE in error["message"], error
    assert LIMIT_S <= took < LIMIT_S + SLACK_S

    assert whole.status_code == 504, whole.text
    assert whole.json()["error"]["code"] == "job_timeout"
    assert whole.json()["error"]["type"] == "server_error"
    assert MESSAGE in whole.json()["error"]["message"]
    assert LIMIT_S <= waited < LIMIT_S + SLACK_S

    # Both were stopped at the worker: its llama-server is idle long before 2000 tokens.
    wait_until(lambda: not generating(router), 5, "the worker to stop generating")
    quick = http_calls.post(url, json={**LONG, "max_tokens": 4}, headers=router.headers, timeout=30)
    assert quick.status_code == 200, quick.text

    job = http_calls.post(
        router.url + "/v1/jobs", json={"type": "chat_completion", **LONG}, headers=router.headers
    )
    assert job.status_code == 202, job.text
    job_url = f"{router.url}/v1/jobs/{job.json()['id']}"

    def failed() -> dict[str, Any] | None:
        record: dict[str, Any] = http_calls.get(job_url, headers=router.headers).json()
        return record if record["status"] == "failed" else None

    record = wait_until(failed, LIMIT_S + 10, "the async job to fail")
    assert record["error"]["code"] == "job_timeout" and MESSAGE in record["error"]["message"]
    wait_until(lambda: not generating(router), 5, "the worker to stop the async job")
