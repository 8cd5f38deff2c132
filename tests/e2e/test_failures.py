"""What happens when parts die: llama-server, a worker mid-stream, the router."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from cluster import API_KEY, MODEL, Cluster, wait_until

pytestmark = pytest.mark.e2e

HELLO = [{"role": "user", "content": "Say hello."}]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


def test_killed_llama_server_restarts_and_serves(cluster: Cluster) -> None:
    router = cluster.router()
    cluster.worker(router)
    [worker] = router.wait_workers(1)
    old_backend = worker["backend_url"]
    pid = int(worker["detail"].rsplit("pid ", 1)[1].rstrip(")"))
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: router.workers()[0]["state"] != "ready", 15, "the worker to notice")
    [worker] = router.wait_workers(1)
    assert "pid" in worker["detail"] and str(pid) not in worker["detail"]
    r = _client(router.url).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    assert r.choices[0].message.content
    assert old_backend != worker["backend_url"] or True  # a new port is allowed, not required


def test_worker_killed_mid_stream_ends_stream_with_error(cluster: Cluster) -> None:
    router = cluster.router()
    worker = cluster.worker(router)
    router.wait_workers(1)
    stream = _client(router.url).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell a long story."}],
        max_tokens=1000,
        stream=True,
    )
    got = 0
    t0 = time.monotonic()
    with pytest.raises(openai.APIError, match="worker serving this request was lost"):
        for _ in stream:
            got += 1
            if got == 3:
                os.kill(worker.pid, signal.SIGKILL)
    assert got >= 3
    assert time.monotonic() - t0 < 10


def test_worker_lost_before_first_token_requeues(cluster: Cluster) -> None:
    router = cluster.router("--max-wait", "30")
    doomed = cluster.worker(router, "--slots", "1", name="doomed")
    router.wait_workers(1)
    client = _client(router.url)
    # Occupy the only slot, then queue a request behind it and add a second worker after
    # killing the first: the held request fails, the queued one is served by the newcomer.
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        timeout=30,
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": MODEL,
            "stream": True,
            "max_tokens": 500,
            "messages": [{"role": "user", "content": "Tell a story."}],
        },
    ) as r:
        next(r.iter_lines())
        os.kill(doomed.pid, signal.SIGKILL)
        cluster.worker(router, name="rescuer")
        answer = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
        assert answer.choices[0].message.content


def test_router_restart_worker_reconnects(cluster: Cluster) -> None:
    router = cluster.router()
    cluster.worker(router)
    router.wait_workers(1)
    assert router.proc.stop() is not None
    router2 = cluster.router(port=router.port)
    router2.wait_workers(1, timeout=30)
    r = _client(router2.url).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    assert r.choices[0].message.content


def test_health_is_open_and_reports_workers(cluster: Cluster) -> None:
    router = cluster.router()
    body = httpx.get(router.url + "/health").json()
    assert body["status"] == "no_ready_workers" and body["workers"] == 0
    cluster.worker(router)
    router.wait_workers(1)
    body = httpx.get(router.url + "/health").json()
    assert body["status"] == "ok" and body["models"] == [MODEL]
