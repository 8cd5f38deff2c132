"""Idle workers heartbeat at the fleet's pace (``--heartbeat-rate``), a busy one at the base:
a real router and real workers attached to one real llama-server.

The router here takes 1 heartbeat a second from idle workers at a 1 s base interval, so three
workers are told to beat every 4 s (``HeartbeatInterval``); with ``--heartbeat-misses 2`` a
router counting misses at the base interval would drop them after 2 s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cluster import Cluster, plain_llama_server, wait_until

pytestmark = pytest.mark.e2e

REDIS_URL = "redis://127.0.0.1:6379/0"
IDLE = ("idle-1", "idle-2")
BUSY = "busy"


@pytest.fixture
def shared_llama(llama_server: Path, model_path: Path, tmp_path: Path) -> Iterator[str]:
    args = ("-np", "3", "-c", "6144", "--threads", "1", "--no-webui")
    with plain_llama_server(llama_server, model_path, tmp_path / "shared.log", *args) as url:
        yield url


def seen_ago(workers: list[dict[str, object]]) -> dict[str, float]:
    return {str(w["name"]): float(str(w["last_seen_s_ago"])) for w in workers}


@pytest.mark.parametrize("queue", ["memory", "redis"])
def test_idle_workers_slow_down_with_the_fleet_and_a_busy_one_beats_at_the_base(
    cluster: Cluster, shared_llama: str, queue: str, redis_prefix: str
) -> None:
    shared = ["--redis-url", REDIS_URL, "--redis-prefix", redis_prefix] if queue == "redis" else []
    router = cluster.router("--heartbeat-rate", "1", "--heartbeat-misses", "2", *shared)
    procs = {}
    for name in (*IDLE, BUSY):
        alias = BUSY if name == BUSY else "idle-model"
        procs[name] = cluster.worker(
            router,
            "--backend-url",
            shared_llama,
            "--model-alias",
            alias,
            name=name,
            model=False,
        )
    router.wait_workers(3)
    told = "heartbeat every 4 s while idle"
    wait_until(lambda: all(told in p.log() for p in procs.values()), 30, "the 4 s pace")

    # Idle: silent for longer than the base interval, never dropped (2 misses of 1 s).
    longest = {name: 0.0 for name in procs}
    end = time.monotonic() + 9
    while time.monotonic() < end:
        workers = router.workers()
        assert {w["name"] for w in workers} == set(procs), "a worker was dropped"
        for name, ago in seen_ago(workers).items():
            longest[name] = max(longest[name], ago)
        time.sleep(0.1)
    assert all(longest[name] > 2.0 for name in procs), longest

    # Busy: a long prompt, not streamed (no frame until its answer): it beats every 1 s.
    body = {
        "model": BUSY,
        "messages": [{"role": "user", "content": "Count the words: " + "word " * 1200}],
        "max_tokens": 32,
    }
    answered: list[int] = []
    call = threading.Thread(
        target=lambda: answered.append(
            httpx.post(
                router.url + "/v1/chat/completions", json=body, headers=router.headers, timeout=120
            ).status_code
        )
    )
    call.start()
    wait_until(
        lambda: next(w for w in router.workers() if w["name"] == BUSY)["running_jobs"],
        30,
        "the job on the busy worker",
    )
    time.sleep(1.5)  # a beat at the base is due by now, whatever the idle pace was
    busiest = 0.0
    while call.is_alive():
        workers = router.workers()
        assert {w["name"] for w in workers} == set(procs), "a worker was dropped"
        busiest = max(busiest, seen_ago(workers)[BUSY])
        time.sleep(0.1)
    call.join()
    assert answered == [200]
    assert busiest < 1.9, f"the busy worker was silent for {busiest:.1f} s"
