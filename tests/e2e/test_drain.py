"""Scaling down loses no answer, and an autoscaler sees the whole cluster from any router.

Two real routers on one Redis (this test's own key prefix), one real worker with one slot on
router A, a real llama-server and the default model. A stream holds the slot (its llama-server
is paused with SIGSTOP so the test needs no timing), a second request waits behind it:
router B, which has no worker of its own, reports the queue, the oldest wait and the busy slot
of A's worker (``GET /api/v1/autoscaling``, admin key only) and A's ``/metrics`` the same
figures. Then the worker gets SIGTERM: it drains (B lists it draining), its stream completes
when llama-server goes on, the waiting request is not given to it, and it exits by itself.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

import http_calls
from cluster import API_KEY, MODEL, Cluster, Router, iter_sse, llama_server_pids, wait_until

pytestmark = pytest.mark.e2e

REDIS_URL = "redis://127.0.0.1:6379/0"
ADMIN_KEY = "ak-test-autoscaling"
SCALING = "/api/v1/autoscaling"


def ask(router: Router, max_tokens: int) -> Iterator[httpx.Response]:
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "messages": [{"role": "user", "content": "Count to fifty."}],
    }
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with http_calls.stream(
        "POST", router.url + "/v1/chat/completions", json=body, headers=auth, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        yield r


def stream_all(router: Router, first_chunk: threading.Event) -> tuple[int, list[str]]:
    """The whole stream: its number of content chunks and every data payload."""
    payloads = []
    for r in ask(router, max_tokens=80):
        for data in iter_sse(r):
            payloads.append(data)
            first_chunk.set()
    return len(payloads) - 1, payloads


def wait_in_queue(router: Router, stop: threading.Event) -> str:
    """A request that waits (its stream carries queue comments) until ``stop``; then the
    client goes away. What it last read."""
    last = ""
    for r in ask(router, max_tokens=4):
        for line in r.iter_lines():
            last = line or last
            if stop.is_set() or line.startswith("data: "):
                return last
    return last


def scaling(router: Router) -> dict[str, Any]:
    r = http_calls.get(
        router.url + SCALING, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5
    )
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    assert body["scope"] == "cluster"
    model: dict[str, Any] = body["models"].get(MODEL, {})
    return model


def gauges(router: Router) -> dict[str, float]:
    r = http_calls.get(
        router.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5
    )
    r.raise_for_status()
    found = {}
    for line in r.text.splitlines():
        if line.startswith("shoal_cluster_") and f'model="{MODEL}"' in line:
            name, value = line.split("{")[0], line.rsplit(" ", 1)[1]
            found[name] = float(value)
    return found


def gone(figures: dict[str, Any]) -> dict[str, Any] | None:
    """``figures`` once they count no worker, else None (``wait_until`` goes on)."""
    return figures if figures.get("workers") == 0 else None


def showing(figures: dict[str, Any], name: str) -> dict[str, Any] | None:
    """``figures`` once they show one request waiting, else None (``wait_until`` goes on)."""
    return figures if figures.get(name) == 1 else None


def test_a_worker_told_to_stop_drains_and_every_router_reports_the_signals(
    cluster: Cluster, redis_prefix: str
) -> None:
    shared = ("--redis-url", REDIS_URL, "--redis-prefix", redis_prefix, "--max-wait", "120")
    a = cluster.router(*shared, "--admin-key", ADMIN_KEY)
    b = cluster.router(*shared, "--admin-key", ADMIN_KEY)  # no worker of its own
    # Its paused llama-server is not taken for hung (--backend-stall-timeout 0).
    slow = ("--slots", "1", "--drain-timeout", "60", "--backend-stall-timeout", "0")
    worker = cluster.worker(a, *slow, name="drains")
    wait_until(lambda: scaling(b).get("ready_slots") == 1, 60, "B to see A's ready worker")

    # The admin endpoint is the control plane's: an inference key, or none, is refused.
    for headers in ({"Authorization": f"Bearer {API_KEY}"}, {}):
        assert http_calls.get(b.url + SCALING, headers=headers).status_code in (401, 403)

    first_chunk, stop_waiting = threading.Event(), threading.Event()
    with ThreadPoolExecutor(2) as pool:
        streaming = pool.submit(stream_all, a, first_chunk)
        assert first_chunk.wait(60), "the first stream never started"
        [server] = llama_server_pids(cluster.tag)
        os.kill(server, signal.SIGSTOP)  # the stream holds the slot while the test looks
        try:
            waiting = pool.submit(wait_in_queue, b, stop_waiting)
            held = wait_until(
                lambda: showing(scaling(b), "queue_depth"),
                15,
                "B to report the waiting request",
            )
            assert held["busy_slots"] == 1 and held["ready_slots"] == 0, held
            assert held["workers"] == 1 and held["oldest_wait_s"] > 0, held
            seen = wait_until(
                lambda: showing(gauges(a), "shoal_cluster_queue_depth"),
                15,
                "A's gauges to show the waiting request",
            )
            assert seen["shoal_cluster_busy_slots"] == 1, seen
            assert seen["shoal_cluster_ready_slots"] == 0, seen
            assert seen["shoal_cluster_oldest_wait_seconds"] > 0, seen

            worker.signal(signal.SIGTERM)
            wait_until(lambda: scaling(b).get("draining_workers") == 1, 15, "B to see it draining")
            assert worker.alive(), "it left with a stream in flight"
        finally:
            os.kill(server, signal.SIGCONT)

        chunks, payloads = streaming.result(60)
        assert payloads[-1] == "[DONE]" and chunks > 1, payloads[-3:]
        assert '"finish_reason":"length"' in "".join(payloads).replace(" ", "")
        assert worker.wait(30) == 0, worker.log()[-3000:]
        log = worker.log()
        assert "drained: every job answered" in log, log[-3000:]
        assert "cancelling" not in log, log[-3000:]  # it stopped with nothing left to cancel

        # The waiting request was never given to the draining worker: it still waits. (B
        # hears that the worker left at the next sync of the worker directory.)
        after = wait_until(lambda: gone(scaling(b)), 15, "B to see the worker gone")
        assert after["queue_depth"] == 1, after
        assert len(re.findall(r"job \S+ model=\S+ endpoint=\S+ stream=\S+: started", log)) == 1
        stop_waiting.set()
        assert waiting.result(60).startswith(":"), "the second request was answered"
