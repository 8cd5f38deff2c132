"""Cache-aware routing through real routers, workers and llama-servers (``--routing prefix``):
a tenant's requests go back to the worker whose llama-server holds its system prompt and
reuse it; a hot tenant stays there while a slot is free, then spills to another worker; a
restarted llama-server holds nothing, and the router stops counting on it. With several
routers on one Redis, a request sent to one router waits briefly for the router whose worker
holds its prompt, or for the pull worker that holds it."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

import http_calls
from cluster import MODEL, Cluster, Router, wait_until
from shoal.worker.link.redis_pull import consumer_name

pytestmark = pytest.mark.e2e

Client = Callable[..., openai.OpenAI]


def system_prompt(tenant: str, rules: int = 30) -> str:
    """About 1.6 KB (~400 tokens, 6 prefix blocks): worth more than a half-busy worker."""
    text = " ".join(f"Rule {i} of {tenant}: answer in one short sentence." for i in range(rules))
    return f"You are the assistant of {tenant}. {text}"


def messages(tenant: str, question: str, rules: int = 30) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": system_prompt(tenant, rules)},
        {"role": "user", "content": question},
    ]


def ask(
    client: openai.OpenAI, tenant: str, question: str = "Hi?", rules: int = 30
) -> tuple[str, int]:
    """The worker that answered, and the prompt tokens it reused."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages(tenant, question, rules), max_tokens=2, temperature=0
    )
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return raw.headers["x-shoal-worker"], usage.prompt_tokens_details.cached_tokens or 0


def by_id(router: Router) -> dict[str, dict[str, Any]]:
    return {w["id"]: w for w in router.workers()}


def two_workers(cluster: Cluster, *args: str, slots: int = 2) -> Router:
    router = cluster.router(*args)
    for name in ("w1", "w2"):
        cluster.worker(router, "--slots", str(slots), name=name)
    router.wait_workers(2)
    return router


def test_a_tenant_returns_to_the_worker_holding_its_prompt(
    cluster: Cluster, make_client: Client, routing: str = "prefix"
) -> None:
    """(Run with ``routing="least-loaded"`` it shows the other outcome.)"""
    router = two_workers(cluster, "--routing", routing)
    client = make_client(router.url)
    a1, _ = ask(client, "tenant-a")
    b1, _ = ask(client, "tenant-b")
    assert a1 != b1  # both idle: the second goes to the other worker
    b2, b2_cached = ask(client, "tenant-b", "And then?")
    a2, a2_cached = ask(client, "tenant-a", "And then?")
    if routing == "least-loaded":  # idle the longest wins: each lands where the other was
        assert (b2, a2) == (a1, b1)
        return
    assert (a2, b2) == (a1, b1)
    assert a2_cached >= 300 and b2_cached >= 300  # the system prompt (~400 tokens) was reused
    for proc in cluster.procs:  # each worker measured its llama-server's prompt speed
        if proc.log_path.name.endswith("-worker.log"):
            assert re.search(r"prompt speed: [\d.]+ ms per token", proc.log()), proc.log()[-2000:]
    held = by_id(router)
    assert held[a1]["cached_blocks"] and held[b1]["cached_blocks"]
    metrics = http_calls.get(router.url + "/metrics", headers=router.headers, timeout=5).text
    cached = re.search(r'shoal_prompt_tokens_total\{model="[^"]+",source="cached"\} (\S+)', metrics)
    assert cached is not None and float(cached.group(1)) >= a2_cached + b2_cached


@pytest.fixture
def streams() -> Iterator[list[Any]]:
    """Streams held open by a test, closed (cancelling their jobs) at the end."""
    opened: list[Any] = []
    yield opened
    for stream in opened:
        stream.close()


def test_a_hot_tenant_stays_while_a_slot_is_free_then_spills(
    cluster: Cluster, make_client: Client, streams: list[Any]
) -> None:
    router = two_workers(cluster)
    client = make_client(router.url)
    home, _ = ask(client, "tenant-a")

    def hold_a_slot() -> str:
        """A long answer for tenant-a, left running: the worker it went to."""
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages(tenant="tenant-a", question="Count to a thousand."),
            max_tokens=1000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        stream = raw.parse()
        streams.append(stream)
        next(iter(stream))  # it is running
        return raw.headers["x-shoal-worker"]

    assert hold_a_slot() == home  # one slot of two busy: its prompt is worth more
    assert hold_a_slot() == home
    spilled, _ = ask(client, "tenant-a", "Still there?")  # home is full: the other worker
    assert spilled != home
    assert set(by_id(router)[spilled]["cached_blocks"]) >= set(by_id(router)[home]["cached_blocks"])


def test_a_restarted_llama_server_holds_nothing(cluster: Cluster, make_client: Client) -> None:
    router = two_workers(cluster)
    client = make_client(router.url)
    short = 8  # rules: a system prompt of two prefix blocks is enough here, and quick
    first, _ = ask(client, "tenant-a", rules=short)
    other, _ = ask(client, "tenant-b", rules=short)
    again, _ = ask(client, "tenant-c", rules=short)
    assert again == first  # now `other` has been idle the longest
    worker = by_id(router)[first]
    assert worker["cached_blocks"]
    pid = int(worker["detail"].rsplit("pid ", 1)[1].rstrip(")"))
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: by_id(router)[first]["state"] != "ready", 15, "the worker to notice")
    router.wait_workers(2)
    wait_until(lambda: not by_id(router)[first]["cached_blocks"], 15, "its holdings to clear")
    # the new llama-server listens on a new port: the router lists that one (not the dead one's)
    assert (
        http_calls.get(by_id(router)[first]["backend_url"] + "/health", timeout=5).status_code
        == 200
    )
    # Were tenant-a's prompt still counted on `first`, it would go there; it goes by load.
    back, _ = ask(client, "tenant-a", "Hello again?", rules=short)
    assert back == other


def test_a_prefix_held_behind_another_router_is_reused_there(
    cluster: Cluster, make_client: Client, redis_prefix: str
) -> None:
    """Two routers on one Redis, one worker each: a tenant's second request, sent to the
    router that does not hold the worker that served its first, is held for the router that
    does, and lands on that worker, reusing its system prompt."""
    shared = ("--redis-url", "redis://127.0.0.1:6379/0", "--redis-prefix", redis_prefix)
    routers = [cluster.router(*shared) for _ in range(2)]
    for router, name in zip(routers, ("w1", "w2"), strict=True):
        cluster.worker(router, "--slots", "2", name=name)
        router.wait_workers(1)
    for router in routers:
        wait_until(lambda r=router: len(r.workers()) == 2 or None, 15, "both workers listed")
    owner = {
        w["id"]: r
        for r, name in zip(routers, ("w1", "w2"), strict=True)
        for w in r.workers()
        if w["name"] == name
    }
    for first_to, tenant in zip(routers, ("tenant-a", "tenant-b"), strict=True):
        served, _ = ask(make_client(first_to.url), tenant)
        other = next(r for r in routers if r is not owner[served])
        wait_until(
            lambda o=other, w=served: by_id(o)[w]["cached_blocks"] or None,
            15,
            "the other router to see what the worker holds",
        )
        again, cached = ask(make_client(other.url), tenant, "And then?")
        assert again == served
        assert cached >= 300  # the system prompt (~400 tokens) was reused
        assert "where a worker holds its prefix" in other.proc.log()


def test_a_prefix_a_pull_worker_holds_is_reused_there(
    cluster: Cluster, make_client: Client, redis_prefix: str
) -> None:
    """A router and two pull workers on one Redis: a tenant's second request is held for the
    pull worker that served its first (by the name it claims under), which takes it and
    reuses its system prompt, while the other pull worker, as free, passes it over."""
    redis_url = "redis://127.0.0.1:6379/0"
    router = cluster.router("--redis-url", redis_url, "--redis-prefix", redis_prefix)
    for name in ("p1", "p2"):
        cluster.pull_worker(redis_url, redis_prefix, "--slots", "2", name=name)
    router.wait_workers(2)
    client = make_client(router.url)
    for tenant in ("tenant-a", "tenant-b"):
        served, _ = ask(client, tenant)
        wait_until(
            lambda w=served: by_id(router)[w]["cached_blocks"] or None,
            15,
            "the router to see what the pull worker holds",
        )
        again, cached = ask(client, tenant, "And then?")
        assert again == served
        assert cached >= 300  # the system prompt (~400 tokens) was reused
        assert f"for {consumer_name(served)}, where a worker holds its prefix" in router.proc.log()
