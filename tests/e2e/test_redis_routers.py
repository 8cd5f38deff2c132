"""Several routers on one Redis: any router serves any request with any router's workers,
and killing one router loses only the requests whose client was connected to it.

Real router, worker and llama-server processes and a real Redis (127.0.0.1:6379); every
test uses its own key prefix and deletes its keys afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import redis

import http_calls
from cluster import API_KEY, MODEL, Cluster, Router, iter_sse, wait_until

pytestmark = pytest.mark.e2e

REDIS_URL = "redis://127.0.0.1:6379/0"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ASK = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Say hi"}]}


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    prefix = f"shoal-e2e-{uuid.uuid4().hex[:8]}:"
    yield prefix
    client = redis.Redis(host="127.0.0.1", port=6379)
    try:
        for key in client.scan_iter(match=prefix + "*", count=500):
            client.unlink(key)
    finally:
        client.close()


def shared_router(cluster: Cluster, prefix: str, *args: str, port: int | None = None) -> Router:
    return cluster.router("--redis-url", REDIS_URL, "--redis-prefix", prefix, *args, port=port)


def models(router: Router) -> list[dict[str, object]]:
    r = http_calls.get(router.url + "/v1/models", headers=router.headers, timeout=5)
    r.raise_for_status()
    data: list[dict[str, object]] = r.json()["data"]
    return data


def worker_ids(router: Router) -> list[str]:
    return sorted(str(w["id"]) for w in router.workers())


def test_request_to_one_router_is_served_by_a_worker_on_another(
    cluster: Cluster, redis_prefix: str
) -> None:
    a = shared_router(cluster, redis_prefix)
    b = shared_router(cluster, redis_prefix)
    cluster.worker(a, name="on-a")
    [on_a] = a.wait_workers(1)
    # B lists A's worker (marked as held by A's router) and its model.
    listed = wait_until(lambda: b.workers() or None, 10, "router B to list A's worker")
    assert [w["id"] for w in listed] == [on_a["id"]]
    assert listed[0]["router"] == a.workers()[0]["router"]
    assert worker_ids(a) == worker_ids(b)
    # B's open /health counts A's worker too (the cluster's, not just its own), once B's
    # copy of the worker list has it ready.
    health = wait_until(
        lambda: (h := http_calls.get(b.url + "/health", timeout=5).json())["ready_workers"] and h,
        10,
        "router B's /health to count A's ready worker",
    )
    assert health["queue"] == "redis" and health["status"] == "ok", health
    assert health["workers"] == health["ready_workers"] == 1 and health["models"] == [MODEL]
    assert [m["id"] for m in models(b)] == [m["id"] for m in models(a)] == [MODEL]
    assert models(b)[0]["workers"] == 1

    r = http_calls.post(b.url + "/v1/chat/completions", json=ASK, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    job_id = r.headers["x-request-id"]
    assert f"job {job_id} model={MODEL} (attempt 1) -> worker {on_a['id']}" in a.proc.log()

    with http_calls.stream(
        "POST",
        b.url + "/v1/chat/completions",
        json={**ASK, "stream": True},
        headers=AUTH,
        timeout=60,
    ) as s:
        assert s.status_code == 200
        payloads = list(iter_sse(s))
    assert payloads[-1] == "[DONE]" and len(payloads) >= 2

    # An unknown model is still a 404 on either router.
    r = http_calls.post(b.url + "/v1/chat/completions", json={**ASK, "model": "nope"}, headers=AUTH)
    assert r.status_code == 404


@dataclass
class Tally:
    """What one client thread saw: request ids answered, and failures with their times."""

    ok: list[str] = field(default_factory=list)
    failed: list[tuple[float, float, str]] = field(default_factory=list)


def ask_until(
    router_url: str,
    stop: threading.Event,
    tally: Tally,
    body: dict[str, object] = ASK,
    most: int | None = None,
) -> None:
    """Send requests one after the other until ``stop`` (or ``most`` were sent)."""
    sent = 0
    with httpx.Client(headers=AUTH, timeout=60) as client:
        while not stop.is_set() and (most is None or sent < most):
            sent += 1
            t0 = time.monotonic()
            try:
                r = client.post(router_url + "/v1/chat/completions", json=body)
            except httpx.TransportError as exc:
                tally.failed.append((t0, time.monotonic(), type(exc).__name__))
                time.sleep(0.2)  # the router is down: the client backs off a little
                continue
            if r.status_code == 200 and r.json()["choices"][0]["message"]["content"]:
                tally.ok.append(r.headers["x-request-id"])
            else:
                tally.failed.append((t0, time.monotonic(), f"{r.status_code} {r.text[:200]}"))


def finals(client: redis.Redis, prefix: str, job_id: str) -> list[str]:
    """The final events (result/done/failed) in a job's output stream."""
    kinds = [json.loads(e[b"e"])["t"] for _, e in client.xrange(f"{prefix}job:{job_id}:out")]
    return [k for k in kinds if k in ("result", "done", "failed")]


PROBES = 3


def probe_jobs(client: redis.Redis, prefix: str) -> dict[str, dict[bytes, bytes]]:
    """The long-prompt probe jobs in Redis, by id (a SCAN: tests only)."""
    found: dict[str, dict[bytes, bytes]] = {}
    for key in client.scan_iter(match=f"{prefix}job:*", count=500):
        if key.endswith(b":out"):
            continue
        job = client.hgetall(key)
        if b"PROBE" in job.get(b"body", b""):
            found[key.decode().rsplit(":", 1)[1]] = job
    return found


def test_killing_one_router_loses_only_its_own_requests(
    cluster: Cluster, redis_prefix: str
) -> None:
    a = shared_router(cluster, redis_prefix)
    b = shared_router(cluster, redis_prefix)
    cluster.worker(a, "--slots", "3", name="on-a")
    cluster.worker(b, "--slots", "3", name="on-b")
    a.wait_workers(2)
    listed = b.wait_workers(2)
    assert worker_ids(a) == worker_ids(b)
    router_b = next(str(w["router"]) for w in listed if w["name"] == "on-b")

    stop = threading.Event()
    to_a, to_b, probes = Tally(), Tally(), Tally()
    # Long answers, not streamed: no output reaches Redis until the whole answer is done.
    body = {**ASK, "max_tokens": 150, "ignore_eos": True}
    body["messages"] = [{"role": "user", "content": "PROBE: tell a story"}]
    threads = [
        threading.Thread(target=ask_until, args=(a.url, stop, to_a)),
        threading.Thread(target=ask_until, args=(b.url, stop, to_b)),
    ] + [
        threading.Thread(target=ask_until, args=(a.url, stop, probes, body)) for _ in range(PROBES)
    ]
    client = redis.Redis(host="127.0.0.1", port=6379)
    try:
        for t in threads:
            t.start()
        wait_until(lambda: len(to_a.ok) >= 5 and len(to_b.ok) >= 5, 30, "requests to flow")
        # Kill B while it holds one of A's long requests that has no output yet.
        held_by_b = wait_until(
            lambda: [
                job_id
                for job_id, j in probe_jobs(client, redis_prefix).items()
                if j.get(b"owner") == router_b.encode() and j.get(b"state") == b"running"
            ],
            30,
            "router B's worker to run a request sent to A",
        )
        killed_at = time.monotonic()
        b.proc.signal(signal.SIGKILL)
        b.proc.wait(10)
        served_while_down = len(to_a.ok)
        time.sleep(3)
        b2 = shared_router(cluster, redis_prefix, port=b.port)
        back_at = time.monotonic()
        wait_until(
            lambda: any(
                w["router"] not in (router_b, None) for w in b2.workers() if w["name"] == "on-b"
            ),
            30,
            "B's worker to reconnect to the new router B",
        )
        after = len(to_b.ok)
        wait_until(lambda: len(to_b.ok) >= after + 5, 60, "router B to serve again")
        wait_until(lambda: len(to_a.ok) >= served_while_down + 10, 60, "router A to go on")
    finally:
        stop.set()
        for t in threads:
            t.join(90)
    try:
        check_answers(client, redis_prefix, to_a, to_b, probes, held_by_b)
    finally:
        client.close()

    for name, tally in (("A", to_a), ("A, long", probes), ("B", to_b)):
        reasons = Counter(why for _, _, why in tally.failed)
        print(f"router {name}: {len(tally.ok)} ok, {len(tally.failed)} failed {dict(reasons)}")
    # Every request sent to A was answered, including those B held when it died.
    assert not to_a.failed and not probes.failed, cluster.logs()
    # B's requests failed only while B was down (or being killed).
    assert to_b.failed
    for started, ended, _ in to_b.failed:
        assert ended >= killed_at - 0.5 and started <= back_at + 1, to_b.failed


def check_answers(
    client: redis.Redis, prefix: str, to_a: Tally, to_b: Tally, probes: Tally, held_by_b: list[str]
) -> None:
    """No request was lost or answered twice; the probes B held when it died were answered
    (run again by another router's worker, or adopted by the new router B from its worker)."""
    answered = to_a.ok + to_b.ok + probes.ok
    assert len(set(answered)) == len(answered)
    for job_id in answered:
        assert finals(client, prefix, job_id) == ["result"], job_id
    assert set(held_by_b) <= set(probes.ok), probe_jobs(client, prefix)


def test_job_of_a_killed_worker_runs_again_on_another(cluster: Cluster, redis_prefix: str) -> None:
    """A worker dies while its job has no output yet (llama-server still reads a long prompt):
    the job goes back to Redis and a worker on the other router answers it."""
    a = shared_router(cluster, redis_prefix, "--max-wait", "60")
    b = shared_router(cluster, redis_prefix, "--max-wait", "60")
    doomed = cluster.worker(a, "--slots", "1", name="doomed")
    [doomed_info] = a.wait_workers(1)
    wait_until(lambda: b.workers() or None, 10, "router B to list the worker")
    long_prompt = "Summarise this text. " + "The quick brown fox jumps over the lazy dog. " * 250
    answer: dict[str, object] = {}

    def ask() -> None:
        body = {**ASK, "max_tokens": 4, "messages": [{"role": "user", "content": long_prompt}]}
        r = http_calls.post(b.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)
        answer["status"] = r.status_code
        answer["id"] = r.headers.get("x-request-id")
        answer["body"] = r.text

    client = threading.Thread(target=ask)
    client.start()
    wait_until(lambda: a.workers()[0]["running_jobs"] == 1, 15, "the job to be assigned")
    os.kill(doomed.pid, signal.SIGKILL)  # ~1,500 prompt tokens: no token has been produced yet
    cluster.worker(b, name="rescuer")
    client.join(90)
    assert answer["status"] == 200, f"{answer}\n{cluster.logs()}"
    job_id = answer["id"]
    log_b = b.proc.log()
    assert f"job {job_id} model={MODEL} (attempt 2) -> worker rescuer-" in log_b, log_b[-3000:]
    assert f"job {job_id} requeued by" in a.proc.log()
    assert doomed_info["id"] not in log_b.split(f"job {job_id} model={MODEL} (attempt 2)")[1][:80]


@pytest.mark.parametrize("restart", [True, False], ids=["router-restarted", "worker-fails-over"])
def test_stream_goes_on_when_the_router_holding_it_dies(
    cluster: Cluster, redis_prefix: str, restart: bool
) -> None:
    """Router B runs a stream for router A's client and is killed mid-answer. Its worker goes
    on generating and reconnects: to B restarted on the same port, or (B gone for good) to A,
    the next router in its ``--router-url`` list. The router it reaches adopts the job: A's
    client gets the whole answer, token for token what an uninterrupted run gives."""
    lease = ("--queue-lease", "30")  # the worker is back well within it
    a = shared_router(cluster, redis_prefix, *lease)
    b = shared_router(cluster, redis_prefix, *lease)
    routers = f"127.0.0.1:{b.port}" + ("" if restart else f",127.0.0.1:{a.port}")
    cluster.worker(b, "--slots", "1", "--router-url", routers, name="on-b")
    b.wait_workers(1)
    wait_until(lambda: a.workers() or None, 10, "router A to list B's worker")
    body = {
        **ASK,
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,  # both runs compute the prompt the same way
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Tell a long story about a lighthouse."}],
    }

    def stream(on_chunk: Callable[[int], None] = lambda n: None) -> tuple[str, str, int, str]:
        text, finish, tokens = [], "", 0
        with http_calls.stream(
            "POST", a.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120
        ) as r:
            assert r.status_code == 200, r.read()
            for data in iter_sse(r):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                assert "error" not in chunk, chunk
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    text.append(choice["delta"].get("content") or "")
                    finish = choice.get("finish_reason") or finish
                on_chunk(len(text))
            return "".join(text), finish, tokens, r.headers["x-request-id"]

    reference, finish, tokens, _ = stream()
    assert finish == "length" and tokens == 300

    took_over: list[Router] = []

    def kill_b_mid_answer(chunks: int) -> None:
        if chunks == 20 and not took_over:
            b.proc.signal(signal.SIGKILL)
            b.proc.wait(10)
            took_over.append(
                shared_router(cluster, redis_prefix, *lease, port=b.port) if restart else a
            )

    text, finish, tokens, job_id = stream(kill_b_mid_answer)
    assert took_over, "the answer ended before router B could be killed"
    assert finish == "length" and tokens == 300
    assert text == reference
    log = took_over[0].proc.log()
    assert f"job {job_id} model={MODEL} adopted: worker on-b-" in log, log[-3000:]
    adopted = next(
        line for line in log.splitlines() if f"job {job_id}" in line and "adopted" in line
    )
    resumed_from = int(adopted.rsplit(" ", 1)[1])
    assert 0 < resumed_from < 300, adopted  # it was mid-answer: part in Redis, part held
    client = redis.Redis(host="127.0.0.1", port=6379)
    try:
        assert finals(client, redis_prefix, job_id) == ["done"]
    finally:
        client.close()
