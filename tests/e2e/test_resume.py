"""An answer whose worker is lost mid-stream goes on on another worker, each token once: the
worker SIGKILLed, its llama-server killed or frozen (SIGSTOP), the worker frozen. Temperature 0
with ``ignore_eos``: the client's text is the uninterrupted one, its usage consistent."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
import pytest
import redis

import http_calls
from cluster import API_KEY, MODEL, Cluster, Proc, Router, iter_sse, wait_until

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
    with http_calls.stream(
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


REDIS_URL = "redis://127.0.0.1:6379/0"
ROUTER_ARGS = ("--heartbeat-misses", "10", "--stall-timeout", "2")
"""Heartbeats time out after 10 s; the stall rule takes 2 s."""


@dataclass
class Fleet:
    """Routers and workers for this module's faults (each test loses a worker). In-process:
    one router, four workers; with Redis: two routers, three workers each (the client calls
    the first; its answer may run on a worker of either)."""

    routers: list[Router]
    procs: dict[str, Proc]
    """Worker id -> its process."""
    reference: Answer
    """The answer uninterrupted."""
    frozen: list[Proc] = field(default_factory=list)

    @property
    def router(self) -> Router:
        return self.routers[0]

    def ready(self) -> None:
        """Wait until every worker not killed or frozen is ready (a llama-server restarts)."""
        live = [p for p in self.procs.values() if p.alive() and p not in self.frozen]
        self.router.wait_workers(len(live))

    def resumed(self, reason: str) -> float:
        return resumed(self.routers, reason)


def resumed(routers: list[Router], reason: str) -> float:
    """``shoal_jobs_resumed_total`` for ``reason``, over every router (a job's holder counts
    it)."""
    line = f'shoal_jobs_resumed_total{{model="{MODEL}",reason="{reason}"}} '
    total = 0.0
    for router in routers:
        text = http_calls.get(router.url + "/metrics", headers=router.headers).text
        total += sum(float(x[len(line) :]) for x in text.splitlines() if x.startswith(line))
    return total


@pytest.fixture(scope="module", params=["memory", "redis"])
def fleet(session_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    prefix = f"shoal-test-{uuid.uuid4().hex[:8]}:"
    shared = ("--redis-url", REDIS_URL, "--redis-prefix", prefix)
    if request.param == "memory":
        routers = [session_cluster.router(*ROUTER_ARGS)]
        placement = {"w1": 0, "w2": 0, "w3": 0, "w4": 0}
    else:
        routers = [session_cluster.router(*ROUTER_ARGS, *shared) for _ in range(2)]
        # three per router: after a worker is killed, whichever router the frozen worker is
        # on still hears another worker (the stall rule counts this router's own workers)
        placement = {"a1": 0, "a2": 0, "a3": 0, "b1": 1, "b2": 1, "b3": 1}
    procs = {
        name: session_cluster.worker(routers[at], "--slots", "1", name=name)
        for name, at in placement.items()
    }
    try:
        workers = routers[0].wait_workers(len(procs))
        ids = {w["id"]: procs[w["name"]] for w in workers}
        yield Fleet(routers, ids, ask(routers[0]))
    finally:
        for proc in procs.values():
            proc.signal(signal.SIGCONT)  # a frozen worker could not stop
            proc.stop()
        for router in routers:
            router.proc.stop()
        if request.param == "redis":
            client = redis.Redis(host="127.0.0.1", port=6379)
            for key in client.scan_iter(match=prefix + "*", count=500):
                client.unlink(key)
            client.close()


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


def report(fleet: Fleet, fault: str, answer: Answer) -> None:
    kind = "redis" if len(fleet.routers) > 1 else "memory"
    print(f"\n{kind}: {fault}: next token {answer.resumed_after_s:.3f} s after the fault")


def test_a_killed_workers_answer_goes_on_on_another(fleet: Fleet) -> None:
    fleet.ready()
    before = fleet.resumed("connection")
    answer = ask(fleet.router, lambda worker: fleet.procs[worker].signal(signal.SIGKILL))
    check_same(answer, fleet.reference)
    assert fleet.resumed("connection") == before + 1
    report(fleet, "kill -9 worker", answer)


def test_an_answer_goes_on_when_its_llama_server_dies(fleet: Fleet) -> None:
    fleet.ready()
    before = fleet.resumed("backend")
    answer = ask(fleet.router, lambda w: os.kill(llama_server_pid(fleet.router, w), signal.SIGKILL))
    check_same(answer, fleet.reference)
    assert fleet.resumed("backend") == before + 1
    report(fleet, "kill -9 llama-server", answer)


BACKEND_STALL_TIMEOUT_S = 10.0
"""The worker's ``--backend-stall-timeout`` by default."""
RESUME_MARGIN_S = 5.0
"""From the kill to the next token: the router hands the answer on, the other worker
prefills the prompt and the tokens sent, and generates (about 1 s on a quiet machine)."""


def test_an_answer_goes_on_when_its_llama_server_hangs(cluster: Cluster) -> None:
    """The serving llama-server stopped (SIGSTOP) mid-answer while its worker lives and
    heartbeats, the other worker idle: the worker takes it for hung within its
    --backend-stall-timeout (default) and kills it, the answer goes on on the other worker,
    whole and each token once, and the worker runs a new llama-server. (Before, the stream
    paused 37 s: three failed health checks 10 s apart, then SIGTERM and a 5 s grace.)"""
    router = cluster.router()
    procs = {name: cluster.worker(router, "--slots", "1", name=name) for name in ("h1", "h2")}
    router.wait_workers(len(procs))
    reference = ask(router)
    stopped: dict[str, int] = {}

    def hang(worker: str) -> None:
        stopped[worker] = llama_server_pid(router, worker)
        os.kill(stopped[worker], signal.SIGSTOP)

    try:
        answer = ask(router, hang)
        check_same(answer, reference)
    except (AssertionError, ValueError, httpx.HTTPError) as exc:
        logs = log_tails([router.proc, *procs.values()], 40)
        raise AssertionError(f"{exc!r}\nreference: {reference}\n{logs}") from exc
    finally:
        for pid in stopped.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # whatever happened, no stopped process is left
    [(worker, old)] = stopped.items()
    pause = answer.resumed_after_s
    print(f"\nSIGSTOP llama-server: next token {pause:.3f} s after the fault")
    assert pause is not None and pause < BACKEND_STALL_TIMEOUT_S + RESUME_MARGIN_S
    assert resumed([router], "backend") == 1

    def replaced() -> bool:
        return any(
            w["id"] == worker and w["state"] == "ready" and llama_server_pid(router, worker) != old
            for w in router.workers()
        )

    wait_until(replaced, 60, "the worker to run a new llama-server")
    assert not psutil.pid_exists(old), "the hung llama-server was killed and reaped"
    [log] = [p.log() for p in procs.values() if "(--backend-stall-timeout)" in p.log()]
    assert "no answer to /health for 10 s while it ran jobs" in log


def test_a_frozen_workers_answer_goes_on_before_its_heartbeats_time_out(fleet: Fleet) -> None:
    fleet.ready()

    def freeze(worker: str) -> None:
        fleet.frozen.append(fleet.procs[worker])
        fleet.procs[worker].signal(signal.SIGSTOP)

    answer = ask(fleet.router, freeze)
    check_same(answer, fleet.reference)
    assert answer.resumed_after_s is not None and answer.resumed_after_s < 6  # not 10 s
    assert fleet.resumed("stall") == 1
    report(fleet, "SIGSTOP worker", answer)


def tasks(backend_url: str) -> dict[int, int]:
    """Tokens generated so far by each task llama-server is working on (by ``id_task``)."""
    try:
        slots = http_calls.get(backend_url + "/slots", timeout=2).json()
    except httpx.HTTPError:  # a llama-server restarting
        return {}
    return {s["id_task"]: s["next_token"][0]["n_decoded"] for s in slots if s["is_processing"]}


def live_backends(fleet: Fleet) -> list[tuple[str, str]]:
    """Live workers' ids, each with its llama-server's address as every router lists it (a
    router's list of another router's workers may lag by a sync, with Redis)."""
    live = {worker for worker, p in fleet.procs.items() if p.alive() and p not in fleet.frozen}
    listed = {(w["id"], w["backend_url"]) for r in fleet.routers for w in r.workers()}
    return sorted((w, url) for w, url in listed if w in live)


def running_tasks(fleet: Fleet) -> dict[str, set[int]]:
    """The tasks each live worker's llama-server is working on now."""
    running: dict[str, set[int]] = {}
    for w, url in live_backends(fleet):
        running.setdefault(w, set()).update(tasks(url))
    return running


def generating(
    fleet: Fleet, before: dict[str, set[int]], seen: list[str]
) -> tuple[str, str, int] | None:
    """The worker generating the answer in flight, its llama-server and the task: one that
    has generated tokens and was not running ``before`` the answer was sent (a generation an
    earlier test's fault left running, even on the same llama-server, is not this answer).
    Each look is appended to ``seen`` (what a timeout reports)."""
    now = [(w, url, tasks(url)) for w, url in live_backends(fleet)]
    seen.append(f"{time.monotonic():.2f} " + repr([(w, url[-5:], t) for w, url, t in now]))
    new = [
        (w, url, task)
        for w, url, running in now
        for task, n in running.items()
        if n > 0 and task not in before.get(w, set())
    ]
    return new[0] if len(new) == 1 else None


def log_tails(procs: list[Proc], lines: int = 15) -> str:
    """The last lines of these routers' and workers' logs (what a timeout reports)."""
    tails = []
    for proc in procs:
        text = proc.log_path.read_text(errors="replace") if proc.log_path.exists() else ""
        tail = "\n".join(text.splitlines()[-lines:])
        tails.append(f"--- {proc.name} ({proc.log_path.name})\n{tail}")
    return "\n".join(tails)


def test_a_killed_workers_non_streamed_answer_goes_on_and_comes_whole(fleet: Fleet) -> None:
    """The worker reports the ids of a non-streamed answer as progress the client does not
    get; killed once its llama-server generated some, another worker goes on from them (not
    from the start: counted as a resume) and the client gets the whole answer, with the
    log-probabilities it asked for, the first worker's included."""
    fleet.ready()
    before = fleet.resumed("connection")
    body = {k: v for k, v in BODY.items() if k not in ("stream", "stream_options")}
    body["logprobs"] = True
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = fleet.router.url + "/v1/chat/completions"
    earlier = running_tasks(fleet)
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, url, json=body, headers=headers, timeout=60)
        # The worker relays each id as llama-server streams it: by FAULT_AFTER tokens the
        # router has the first ones.
        seen: list[str] = []
        try:
            worker, backend, task = wait_until(
                lambda: generating(fleet, earlier, seen), 60, "the answer to start"
            )
        except AssertionError as exc:
            looks = "\n".join(seen[:3] + ["..."] + seen[-10:])  # worker, port, tokens by task
            got = reply.result() if reply.done() and not reply.exception() else reply
            raise AssertionError(
                f"{exc}\nbefore: {earlier}\nreply: {getattr(got, 'text', got)!r:.500}\n"
                f"looks:\n{looks}\n"
                f"{log_tails([r.proc for r in fleet.routers] + list(fleet.procs.values()))}"
            ) from None
        wait_until(lambda: tasks(backend).get(task, 0) >= FAULT_AFTER, 30, "tokens", every=0.01)
        fleet.procs[worker].signal(signal.SIGKILL)
        r = reply.result()
    assert r.status_code == 200, r.text
    assert r.headers["x-shoal-worker"] != worker
    answer = r.json()
    [choice] = answer["choices"]
    assert choice["message"]["content"] == fleet.reference.text
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    assert answer["object"] == "chat.completion"
    entries = choice["logprobs"]["content"]
    assert len(entries) == TOKENS
    assert b"".join(bytes(e["bytes"]) for e in entries) == fleet.reference.text.encode()
    [expected] = fleet.reference.usage
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert {k: answer["usage"][k] for k in counts} == {k: expected[k] for k in counts}
    assert fleet.resumed("connection") == before + 1


def test_a_pull_workers_answer_goes_on_when_its_llama_server_dies(
    cluster: Cluster, redis_prefix: str
) -> None:
    """A pull worker (no router connection) hands the answer back to Redis with what the
    client has; the other pull worker goes on with it."""
    router = cluster.router("--redis-url", REDIS_URL, "--redis-prefix", redis_prefix)
    for name in ("p1", "p2"):
        cluster.pull_worker(REDIS_URL, redis_prefix, "--slots", "1", name=name)
    router.wait_workers(2)
    reference = ask(router)
    answer = ask(router, lambda w: os.kill(llama_server_pid(router, w), signal.SIGKILL))
    check_same(answer, reference)
    print(
        f"\npull: kill -9 llama-server: next token {answer.resumed_after_s:.3f} s after the fault"
    )


def test_a_dead_pull_workers_answer_goes_on_after_its_lease(
    cluster: Cluster, redis_prefix: str
) -> None:
    """A pull worker SIGKILLed mid-answer: nobody's connection closes; after its lease the
    sweep puts the job back with the ids its trail left in Redis, another pull worker goes on."""
    lease = ("--queue-lease", "3")
    router = cluster.router("--redis-url", REDIS_URL, "--redis-prefix", redis_prefix, *lease)
    procs = {
        name: cluster.pull_worker(REDIS_URL, redis_prefix, "--slots", "1", *lease, name=name)
        for name in ("p1", "p2")
    }
    by_id = {w["id"]: procs[w["name"]] for w in router.wait_workers(2)}
    reference = ask(router)
    answer = ask(router, lambda worker: by_id[worker].signal(signal.SIGKILL))
    check_same(answer, reference)
    after = answer.resumed_after_s
    print(f"\npull: kill -9 worker (lease 3 s): next token {after:.3f} s after the fault")


def test_a_routers_only_worker_frozen_is_dropped_for_another_routers_worker(
    cluster: Cluster, redis_prefix: str
) -> None:
    """Two routers on Redis, one worker each: whichever worker streams the answer is its
    router's only one. Frozen, it is still taken for frozen after the stall timeout (the
    other router's worker is heard of through Redis) and the other goes on, well before the
    heartbeat timeout."""
    shared = ("--redis-url", REDIS_URL, "--redis-prefix", redis_prefix)
    routers = [cluster.router(*ROUTER_ARGS, *shared) for _ in range(2)]
    procs = {
        name: cluster.worker(router, "--slots", "1", name=name)
        for name, router in zip(("a1", "b1"), routers, strict=True)
    }
    by_id = {w["id"]: procs[w["name"]] for w in routers[1].wait_workers(2)}
    reference = ask(routers[1])
    frozen: list[Proc] = []

    def freeze(worker: str) -> None:
        frozen.append(by_id[worker])
        by_id[worker].signal(signal.SIGSTOP)

    try:
        answer = ask(routers[1], freeze)
    finally:
        for proc in frozen:
            proc.signal(signal.SIGCONT)  # a frozen worker could not stop
    check_same(answer, reference)
    assert answer.resumed_after_s is not None and answer.resumed_after_s < 6  # not 10 s
    print(
        f"\nredis, one worker per router: SIGSTOP worker: next token {answer.resumed_after_s:.3f} s"
    )
