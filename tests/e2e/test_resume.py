"""An answer whose worker is lost mid-stream goes on on another worker, each token once: the
worker SIGKILLed, its llama-server killed, the worker frozen (SIGSTOP). Temperature 0 with
``ignore_eos``: the client's text is the uninterrupted one, its usage consistent."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from cluster import API_KEY, MODEL, Cluster, Proc, Router, iter_sse

pytestmark = pytest.mark.e2e

TOKENS = 120
FAULT_AFTER = 15
"""Content chunks the client has when the fault is made."""
BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell a long story about a lighthouse keeper."}],
    "max_tokens": TOKENS,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@dataclass
class Answer:
    worker: str = ""
    text: str = ""
    ids: set[str] = field(default_factory=set)
    roles: int = 0
    usage: list[dict[str, Any]] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    done: bool = False
    fault_at: float | None = None
    resumed_after_s: float | None = None
    """The longest wait for a content chunk from the fault on: from the fault to the next
    token of the worker that went on (chunks already on their way arrive sooner)."""


def ask(router: Router, fault: Callable[[str], None] | None = None) -> Answer:
    """Stream ``BODY``; after ``FAULT_AFTER`` content chunks call ``fault(worker id)``."""
    answer = Answer()
    content = 0
    last = 0.0
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json=BODY,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ) as r:
        assert r.status_code == 200, r.read()
        answer.worker = r.headers["x-shoal-worker"]
        for data in iter_sse(r):
            if data == "[DONE]":
                answer.done = True
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            answer.ids.add(chunk["id"])
            if chunk.get("usage"):
                answer.usage.append(chunk["usage"])
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                answer.roles += "role" in delta
                if choice.get("finish_reason"):
                    answer.finish.append(choice["finish_reason"])
                if not delta.get("content"):
                    continue
                answer.text += delta["content"]
                content += 1
                now = time.monotonic()
                if answer.fault_at is not None:
                    gap = now - max(last, answer.fault_at)
                    answer.resumed_after_s = max(answer.resumed_after_s or 0.0, gap)
                last = now
                if fault is not None and content == FAULT_AFTER:
                    fault(answer.worker)
                    answer.fault_at = time.monotonic()
    return answer


@dataclass
class Fleet:
    """One router and three workers for this module's faults (each test loses one): the
    stall rule at 2 s, heartbeats timing out only after 10 s."""

    router: Router
    procs: dict[str, Proc]
    """Worker id -> its process."""
    reference: Answer
    """The answer uninterrupted."""
    frozen: list[Proc] = field(default_factory=list)

    def ready(self) -> None:
        """Wait until every worker not killed or frozen is ready (a llama-server restarts)."""
        live = [p for p in self.procs.values() if p.alive() and p not in self.frozen]
        self.router.wait_workers(len(live))


@pytest.fixture(scope="module")
def fleet(session_cluster: Cluster) -> Iterator[Fleet]:
    router = session_cluster.router("--heartbeat-misses", "10", "--stall-timeout", "2")
    names = ("w1", "w2", "w3")
    procs = {name: session_cluster.worker(router, "--slots", "1", name=name) for name in names}
    try:
        workers = router.wait_workers(3)
        ids = {w["id"]: procs[w["name"]] for w in workers}
        fleet = Fleet(router, ids, ask(router))
        yield fleet
    finally:
        for proc in procs.values():
            proc.signal(signal.SIGCONT)  # a frozen worker could not stop
            proc.stop()
        router.proc.stop()


def check_same(answer: Answer, reference: Answer) -> None:
    assert answer.done, "the stream ended with [DONE]"
    assert answer.text == reference.text
    assert answer.roles == 1 and len(answer.ids) == 1
    [usage], [expected] = answer.usage, reference.usage  # one usage chunk
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert {k: usage[k] for k in counts} == {k: expected[k] for k in counts}
    assert usage["completion_tokens"] == TOKENS  # the prompt once, every token
    assert usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
    assert answer.finish == ["length"]


def llama_server_pid(router: Router, worker_id: str) -> int:
    [info] = [w for w in router.workers() if w["id"] == worker_id]
    return int(info["detail"].rsplit("pid ", 1)[1].rstrip(")"))


def resumed(router: Router, reason: str) -> float:
    metrics = httpx.get(router.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    line = f'shoal_jobs_resumed_total{{model="{MODEL}",reason="{reason}"}} '
    found = [float(x[len(line) :]) for x in metrics.text.splitlines() if x.startswith(line)]
    return found[0] if found else 0.0


def test_a_killed_workers_answer_goes_on_on_another(fleet: Fleet) -> None:
    fleet.ready()
    before = resumed(fleet.router, "connection")
    answer = ask(fleet.router, lambda worker: fleet.procs[worker].signal(signal.SIGKILL))
    check_same(answer, fleet.reference)
    assert resumed(fleet.router, "connection") == before + 1
    print(f"kill -9 worker: next token {answer.resumed_after_s:.3f} s after the fault")


def test_an_answer_goes_on_when_its_llama_server_dies(fleet: Fleet) -> None:
    fleet.ready()
    before = resumed(fleet.router, "backend")
    answer = ask(fleet.router, lambda w: os.kill(llama_server_pid(fleet.router, w), signal.SIGKILL))
    check_same(answer, fleet.reference)
    assert resumed(fleet.router, "backend") == before + 1
    print(f"kill -9 llama-server: next token {answer.resumed_after_s:.3f} s after the fault")


def test_a_frozen_workers_answer_goes_on_before_its_heartbeats_time_out(fleet: Fleet) -> None:
    fleet.ready()

    def freeze(worker: str) -> None:
        fleet.frozen.append(fleet.procs[worker])
        fleet.procs[worker].signal(signal.SIGSTOP)

    answer = ask(fleet.router, freeze)
    check_same(answer, fleet.reference)
    assert answer.resumed_after_s is not None and answer.resumed_after_s < 6  # not 10 s
    assert resumed(fleet.router, "stall") == 1
    print(f"SIGSTOP worker: next token {answer.resumed_after_s:.3f} s after the fault")


REDIS_URL = "redis://127.0.0.1:6379/0"


def test_with_two_routers_on_redis_a_killed_workers_answer_goes_on_through_the_other(
    cluster: Cluster, redis_prefix: str
) -> None:
    """The client calls router A; its answer runs on a worker of either router; that worker
    is SIGKILLed: the job goes back to Redis with what the client has, the other router's
    worker goes on, and A's stream of the job's output has each token once."""
    shared = ("--redis-url", REDIS_URL, "--redis-prefix", redis_prefix)
    a, b = cluster.router(*shared), cluster.router(*shared)
    procs = {
        "wa": cluster.worker(a, "--slots", "1", name="wa"),
        "wb": cluster.worker(b, "--slots", "1", name="wb"),
    }
    workers = a.wait_workers(2)
    by_id = {w["id"]: procs[w["name"]] for w in workers}
    reference = ask(a)
    answer = ask(a, lambda worker: by_id[worker].signal(signal.SIGKILL))
    check_same(answer, reference)
    print(f"kill -9 worker (Redis): next token {answer.resumed_after_s:.3f} s after the fault")
