"""Requests go only where their prompt and answer fit a slot's context: one model on two
workers, 512 and 256 tokens per slot (``--ctx-size``; small, so that the prompts are quick
to compute on a CPU), real llama-servers.

In-process (one router, both workers), with Redis (two routers, one worker each: the client
calls the small worker's router, whose claim must pass over what its worker cannot hold) and
with pull workers (a router with no worker of its own).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis

import http_calls
from cluster import API_KEY, MODEL, Cluster, Proc, Router, iter_sse
from shoal.jobs.failure import CONTEXT_REFUSALS

pytestmark = pytest.mark.e2e

REDIS_URL = "redis://127.0.0.1:6379/0"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LEASE = ("--queue-lease", "30")
BIG, SMALL = 512, 256
LONG = "The quick brown fox jumps over the lazy dog. " * 35
"""About 380 tokens with the chat template (1,575 bytes, 4.5 a token): only the big worker
holds it, and the router's estimate (4 bytes a token) says so."""
DIGITS = "7391"
"""A token a digit with the default model: the router's estimate (4 bytes a token) is a
quarter of the truth, so llama-server is the one to tell that a prompt of them is too long."""


@dataclass
class Fleet:
    mode: str
    router: Router
    """The router the client calls (with Redis: the small worker's)."""
    routers: list[Router]
    """Every router, the client's first."""
    procs: dict[str, Proc]
    ids: dict[str, str]
    """Worker name (big, small) -> its id."""

    def logs(self) -> str:
        procs = [r.proc for r in self.routers] + list(self.procs.values())
        return "\n".join(f"===== {p.log_path.name}\n{p.log()[-3000:]}" for p in procs)


SIZES = {"big": BIG, "small": SMALL}


def sized(name: str) -> tuple[str, ...]:
    return ("--slots", "1", "--ctx-size", str(SIZES[name]))


def start(cluster: Cluster, mode: str, prefix: str) -> tuple[list[Router], dict[str, Proc]]:
    """The routers (the client's first) and the two workers of ``mode``."""
    shared = ("--redis-url", REDIS_URL, "--redis-prefix", prefix)
    if mode == "memory":
        router = cluster.router("--max-wait", "120")
        return [router], {name: cluster.worker(router, *sized(name), name=name) for name in SIZES}
    if mode == "redis":
        big, small = (cluster.router("--max-wait", "120", *shared) for _ in SIZES)
        procs = {"big": cluster.worker(big, *sized("big"), name="big")}
        procs["small"] = cluster.worker(small, *sized("small"), name="small")
        return [small, big], procs  # the client calls the small worker's router
    # one lease for the router and the pull workers (else its sweep takes their jobs)
    router = cluster.router("--max-wait", "120", *LEASE, *shared)
    procs = {
        name: cluster.pull_worker(REDIS_URL, prefix, *sized(name), *LEASE, name=name)
        for name in SIZES
    }
    return [router], procs


def forget(prefix: str) -> None:
    """Delete the Redis keys under ``prefix``."""
    r = redis.Redis(host="127.0.0.1", port=6379)
    for key in r.scan_iter(match=prefix + "*", count=500):
        r.unlink(key)
    r.close()


@pytest.fixture(scope="module", params=["memory", "redis", "pull"])
def fleet(session_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    prefix = f"shoal-test-{uuid.uuid4().hex[:8]}:"
    routers, procs = start(session_cluster, request.param, prefix)
    try:
        workers = routers[0].wait_workers(2, timeout=120)  # (two llama-servers start at once)
        ids = {w["name"]: w["id"] for w in workers}
        yield Fleet(request.param, routers[0], routers, procs, ids)
    finally:
        for proc in procs.values():
            proc.stop()
        for router in routers:
            router.proc.stop()
        if request.param != "memory":
            forget(prefix)


def chat(router: Router, content: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    return http_calls.post(
        router.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120
    )


def test_long_prompts_go_only_to_the_worker_whose_context_holds_them(fleet: Fleet) -> None:
    """Four at once: the small worker is free the whole time, and takes none of them (it
    used to take one, and its llama-server answered 400)."""
    fleet.router.wait_workers(2)
    models = http_calls.get(fleet.router.url + "/v1/models", headers=AUTH).json()["data"]
    assert [m["context_length"] for m in models] == [BIG]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: chat(fleet.router, LONG, max_tokens=8), range(4)))
    assert [r.status_code for r in replies] == [200] * 4, [r.text[:300] for r in replies]
    assert {r.headers["x-shoal-worker"] for r in replies} == {fleet.ids["big"]}
    prompt = replies[0].json()["usage"]["prompt_tokens"]
    assert SMALL < prompt < BIG  # it did not fit the small worker
    short = chat(fleet.router, "Say hi.", max_tokens=4)  # short ones go anywhere
    assert short.status_code == 200


def test_a_prompt_llama_server_refuses_goes_to_the_larger_context(fleet: Fleet) -> None:
    """The estimate says a prompt of digits fits the small worker; its llama-server refuses
    it (330-odd tokens in 256): the job waits for the big worker, busy meanwhile with a
    long answer, and is answered there. The client never sees the refusal."""
    fleet.router.wait_workers(2)
    busy: dict[str, object] = {}
    running = threading.Event()

    def occupy() -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": LONG}],
            "max_tokens": 60,
            "ignore_eos": True,
            "stream": True,
        }
        url = fleet.router.url + "/v1/chat/completions"
        with http_calls.stream("POST", url, json=body, headers=AUTH, timeout=120) as r:
            busy["worker"] = r.headers.get("x-shoal-worker")
            for data in iter_sse(r):
                if data != "[DONE]" and json.loads(data)["choices"]:
                    running.set()
            busy["status"] = r.status_code

    thread = threading.Thread(target=occupy)
    thread.start()
    try:
        assert running.wait(60), fleet.logs()  # the big worker is generating its answer
        reply = chat(fleet.router, DIGITS * 75, max_tokens=8)
    finally:
        thread.join(120)
    assert busy == {"worker": fleet.ids["big"], "status": 200}
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-shoal-worker"] == fleet.ids["big"]
    assert SMALL < reply.json()["usage"]["prompt_tokens"] < BIG
    # it was refused first: by the small worker, whose holder (its router, or itself) said so
    holders = [r.proc for r in fleet.routers] + [fleet.procs["small"]]
    refusal = f"{fleet.ids['small']} has too little context for its prompt"
    assert any(refusal in p.log() for p in holders), fleet.logs()


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"max_tokens": 600}, "max_tokens", "it asks for 600 tokens of answer"),
        ({"max_completion_tokens": BIG}, "max_completion_tokens", f"{BIG} tokens of answer"),
    ],
)
def test_a_request_no_context_can_hold_is_refused_by_the_router_at_once(
    fleet: Fleet, extra: dict[str, Any], param: str, says: str
) -> None:
    fleet.router.wait_workers(2)
    reply = chat(fleet.router, "Say hi.", **extra)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == "context_length_exceeded"
    assert f"the largest holds {BIG} tokens" in error["message"] and says in error["message"]
    assert "Shorten the prompt, or lower max_tokens" in error["message"]


def test_a_prompt_every_llama_server_refuses_gets_the_routers_400(fleet: Fleet) -> None:
    """600 digits: 630-odd tokens, more than either context; by the estimate it fits both,
    so a worker's llama-server is the one to refuse it, and the router answers with the
    largest context there is (not the refusing worker's)."""
    fleet.router.wait_workers(2)
    reply = chat(fleet.router, DIGITS * 150, max_tokens=8)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded", error
    assert f"the largest holds {BIG} tokens" in error["message"]
    assert "Shorten the prompt, or lower max_tokens" in error["message"]


def test_a_worker_that_says_it_holds_more_than_it_does_ends_in_llama_servers_400(
    cluster: Cluster,
) -> None:
    """``--llama-server-args "-c 256"`` overrides ``--ctx-size 512``: the worker says 512,
    its llama-server holds 256. A prompt of ~380 tokens fits what it says, so the router gives
    it back after each refusal; after ``CONTEXT_REFUSALS`` runs beyond ``--max-requeues``
    the client gets llama-server's own 400 (it used to go round until the client gave up)."""
    router = cluster.router("--max-requeues", "2")
    worker = cluster.worker(
        router, "--slots", "1", "--ctx-size", "512", "--llama-server-args", "-c 256", name="liar"
    )
    router.wait_workers(1)
    r = chat(router, LONG, max_tokens=8)
    assert r.status_code == 400, r.text[:300]
    assert "exceeds the available context size" in r.json()["error"]["message"]
    runs = worker.log().count(f"job {r.headers['x-request-id']} model=")
    assert runs == 1 + 2 + CONTEXT_REFUSALS, worker.log()[-2000:]
