"""The same fault gives the same outcome whichever holds the job: a router (in-process, or
through Redis) for its worker, or a pull worker for itself (``jobs/failure.py``, the one
rule). The fault: the worker's llama-server SIGKILLed mid-answer, with ``--resume-attempts
0`` so that the answer cannot go on elsewhere. Temperature 0 with ``ignore_eos``: an answer
run again is the uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis

import http_calls
from cluster import API_KEY, MODEL, Cluster, Proc, Router, iter_sse, wait_until

pytestmark = pytest.mark.e2e

REDIS_URL = "redis://127.0.0.1:6379/0"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOKENS = 60
FAULT_AFTER = 12
"""Tokens generated when llama-server is killed."""
NO_RESUME = ("--resume-attempts", "0")
LEASE = ("--queue-lease", "30")
BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell a long story about a lighthouse keeper."}],
    "max_tokens": TOKENS,
    "temperature": 0,
    "ignore_eos": True,
}


@dataclass
class Rig:
    mode: str
    router: Router
    worker: Proc
    reference: str
    """The answer's text, uninterrupted."""

    def backend(self) -> tuple[int, str]:
        """The worker's llama-server: its pid and address, as the router lists them."""
        [info] = self.router.wait_workers(1, timeout=120)
        return int(info["detail"].rsplit("pid ", 1)[1].rstrip(")")), info["backend_url"]


def start(cluster: Cluster, mode: str, prefix: str) -> tuple[Router, Proc]:
    shared = ("--redis-url", REDIS_URL, "--redis-prefix", prefix)
    if mode == "pull":
        router = cluster.router("--max-wait", "120", *LEASE, *shared)
        args = ("--slots", "1", *NO_RESUME, *LEASE)
        return router, cluster.pull_worker(REDIS_URL, prefix, *args, name="w")
    redis_args = shared if mode == "redis" else ()
    router = cluster.router("--max-wait", "120", *NO_RESUME, *redis_args)
    return router, cluster.worker(router, "--slots", "1", name="w")


@pytest.fixture(scope="module", params=["memory", "redis", "pull"])
def rig(session_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Rig]:
    prefix = f"shoal-test-{uuid.uuid4().hex[:8]}:"
    router, worker = start(session_cluster, request.param, prefix)
    try:
        router.wait_workers(1, timeout=120)
        reply = post(router, BODY)
        assert reply.status_code == 200, reply.text
        yield Rig(request.param, router, worker, reply.json()["choices"][0]["message"]["content"])
    finally:
        worker.stop()
        router.proc.stop()
        if request.param != "memory":
            client = redis.Redis(host="127.0.0.1", port=6379)
            for key in client.scan_iter(match=prefix + "*", count=500):
                client.unlink(key)
            client.close()


def post(router: Router, body: dict[str, Any]) -> httpx.Response:
    url = router.url + "/v1/chat/completions"
    return http_calls.post(url, json=body, headers=AUTH, timeout=180)


def decoded(backend_url: str) -> int:
    """Tokens the llama-server's busy slot has generated (0 when none is busy)."""
    try:
        slots = http_calls.get(backend_url + "/slots", timeout=2).json()
    except httpx.HTTPError:
        return 0
    return max((s["next_token"][0]["n_decoded"] for s in slots if s["is_processing"]), default=0)


def test_a_non_streamed_answer_that_cannot_go_on_runs_again_and_comes_whole(rig: Rig) -> None:
    """Its client has nothing yet, so it runs again from the start: 200 and the whole
    answer, in every mode (a pull worker failed it with a 502; a router ran it again)."""
    pid, backend = rig.backend()
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(post, rig.router, BODY)
        wait_until(lambda: decoded(backend) >= FAULT_AFTER, 60, "tokens", every=0.01)
        os.kill(pid, signal.SIGKILL)
        r = reply.result()
    assert r.status_code == 200, r.text
    answer = r.json()
    [choice] = answer["choices"]
    assert choice["message"]["content"] == rig.reference
    assert choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == TOKENS


def test_a_stream_that_cannot_go_on_ends_with_the_backend_error(rig: Rig) -> None:
    """Its client has part of the stream: it is not run again (the client would get it
    twice) and ends with the worker's error event, in every mode."""
    pid, _ = rig.backend()
    url = rig.router.url + "/v1/chat/completions"
    got, error = 0, None
    started = time.monotonic()
    with http_calls.stream(
        "POST", url, json={**BODY, "stream": True}, headers=AUTH, timeout=180
    ) as r:
        assert r.status_code == 200
        for data in iter_sse(r):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                break
            got += any((c.get("delta") or {}).get("content") for c in chunk["choices"])
            if got == FAULT_AFTER:
                os.kill(pid, signal.SIGKILL)
    assert got >= FAULT_AFTER and error is not None, (got, error)
    assert error["code"] == "backend_error", error
    assert time.monotonic() - started < 60
