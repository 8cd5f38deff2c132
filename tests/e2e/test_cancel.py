"""A client that goes away stops the generation on llama-server within a second."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest

import http_calls
from cluster import API_KEY, MODEL, Cluster, Router, wait_until

pytestmark = pytest.mark.e2e

LONG = {
    "model": MODEL,
    "max_tokens": 2000,
    "temperature": 0.8,
    "ignore_eos": True,
    "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
}
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _busy_slots(backend_url: str) -> int:
    slots = http_calls.get(backend_url + "/slots", timeout=2).json()
    return sum(1 for s in slots if s["is_processing"])


def _backend(router: Router) -> str:
    [worker] = router.wait_workers(1)
    url: str = worker["backend_url"]
    return url


def _idle_after(backend: str) -> float:
    t0 = time.monotonic()
    wait_until(lambda: _busy_slots(backend) == 0, 5, "llama-server to stop generating", every=0.02)
    return time.monotonic() - t0


def test_stream_disconnect_stops_generation(cluster: Cluster) -> None:
    router = cluster.router()
    cluster.worker(router, "--slots", "1")
    backend = _backend(router)
    with http_calls.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json={**LONG, "stream": True},
        headers=HEADERS,
        timeout=30,
    ) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
        assert _busy_slots(backend) == 1
    # the with-block closed the connection mid-stream
    stopped_in = _idle_after(backend)
    assert stopped_in < 1.0, f"generation went on for {stopped_in:.2f} s"


def test_non_stream_disconnect_stops_generation(cluster: Cluster) -> None:
    router = cluster.router()
    cluster.worker(router, "--slots", "1")
    backend = _backend(router)

    def call() -> None:
        with contextlib.suppress(httpx.TimeoutException):
            http_calls.post(
                router.url + "/v1/chat/completions", json=LONG, headers=HEADERS, timeout=0.8
            )

    t = threading.Thread(target=call)
    t.start()
    wait_until(lambda: _busy_slots(backend) == 1, 10, "generation to start")
    t.join()
    stopped_in = _idle_after(backend)
    assert stopped_in < 1.0, f"generation went on for {stopped_in:.2f} s"


def test_queued_request_dropped_when_client_leaves(cluster: Cluster) -> None:
    router = cluster.router()
    cluster.worker(router, "--slots", "1")
    _backend(router)
    with http_calls.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json={**LONG, "stream": True},
        headers=HEADERS,
        timeout=30,
    ) as r:
        next(r.iter_lines())
        # a second request waits in the queue, then its client gives up
        with contextlib.suppress(httpx.TimeoutException):
            http_calls.post(
                router.url + "/v1/chat/completions", json=LONG, headers=HEADERS, timeout=0.5
            )
        models = http_calls.get(router.url + "/v1/models", headers=HEADERS).json()["data"]
        wait_until(
            lambda: (
                http_calls.get(router.url + "/v1/models", headers=HEADERS).json()["data"][0][
                    "queued"
                ]
                == 0
            ),
            3,
            "the abandoned request to leave the queue",
        )
        assert models[0]["id"] == MODEL
