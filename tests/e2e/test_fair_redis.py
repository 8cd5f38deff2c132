"""Fair scheduling across routers sharing one Redis: real routers, worker, llama-server and
Redis (127.0.0.1:6379, a key prefix per test). The fairness state lives in Redis, so a key
flooding through one router does not hold up another key on another router, a key's
``--max-queued`` counts its requests waiting on every router, a waiting stream hears its
place, and a router killed while holding jobs leaves no waiting count behind."""

from __future__ import annotations

import asyncio
import contextlib
import signal

import httpx
import openai
import pytest
import redis
from test_fair_scheduling import ask, auth, holding_the_slot, new_key
from test_redis_routers import REDIS_URL

from cluster import MODEL, Cluster, Router, wait_until

pytestmark = pytest.mark.e2e

FLOOD = 4  # jobs of the heavy key waiting behind the one running


def shared(cluster: Cluster, prefix: str, reader_key: str, *args: str) -> Router:
    router = cluster.router("--redis-url", REDIS_URL, "--redis-prefix", prefix, *args,
                            api_key=None)  # fmt: skip
    router.api_key = reader_key  # for the router's own reads (/v1/models)
    return router


def waiting_in_redis(prefix: str) -> dict[str, int]:
    """Jobs waiting per key, as the routers' scripts count them (``{p}keys:waiting``)."""
    client = redis.Redis(host="127.0.0.1", port=6379, decode_responses=True)
    try:
        return {k: int(v) for k, v in client.hgetall(f"{prefix}keys:waiting").items()}
    finally:
        client.close()


def running(prefix: str) -> int:
    """Jobs claimed (leases in the queue's stream)."""
    client = redis.Redis(host="127.0.0.1", port=6379)
    try:
        return int(client.xlen(f"{prefix}q:{MODEL}:chat"))
    finally:
        client.close()


def total_waiting(prefix: str) -> int:
    return sum(waiting_in_redis(prefix).values())


async def until_waiting(prefix: str, count: int) -> None:
    await asyncio.to_thread(
        wait_until, lambda: total_waiting(prefix) == count, 30, f"{count} waiting in Redis"
    )


def test_a_light_key_on_one_router_goes_ahead_of_a_flood_through_another(
    cluster: Cluster, redis_prefix: str
) -> None:
    heavy, light = new_key(cluster, "heavy"), new_key(cluster, "light")
    a = shared(cluster, redis_prefix, light)
    b = shared(cluster, redis_prefix, light)
    cluster.worker(a, "--slots", "1")
    a.wait_workers(1)
    b.wait_workers(1)  # b sees a's worker through Redis before it is asked
    done: list[str] = []

    async def scenario() -> None:
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=120) as to_a,
            httpx.AsyncClient(base_url=b.url, timeout=120) as to_b,
        ):

            async def one(client: httpx.AsyncClient, name: str, key: str, tokens: int) -> None:
                r = await client.post("/v1/chat/completions", json=ask(tokens), headers=auth(key))
                assert r.status_code == 200, r.text
                done.append(name)

            async with asyncio.TaskGroup() as tg:
                for i in range(FLOOD + 1):
                    tg.create_task(one(to_a, f"heavy{i}", heavy, 32))
                await until_waiting(redis_prefix, FLOOD)
                tg.create_task(one(to_b, "light", light, 8))

    asyncio.run(scenario())
    assert done.index("light") == 1, done  # after the heavy job running, ahead of the flood
    assert waiting_in_redis(redis_prefix) == {}


def test_a_capped_key_is_refused_on_any_router_while_another_key_is_served(
    cluster: Cluster, redis_prefix: str
) -> None:
    capped = new_key(cluster, "capped", "--max-queued", "2")
    other = new_key(cluster, "other")
    a = shared(cluster, redis_prefix, other)
    b = shared(cluster, redis_prefix, other)
    cluster.worker(a, "--slots", "1")
    a.wait_workers(1)
    b.wait_workers(1)  # b sees a's worker through Redis before it is asked
    answers: list[str] = []

    async def scenario() -> None:
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=120) as to_a,
            httpx.AsyncClient(base_url=b.url, timeout=120) as to_b,
        ):

            async def one(client: httpx.AsyncClient, name: str, key: str) -> None:
                r = await client.post("/v1/chat/completions", json=ask(4), headers=auth(key))
                assert r.status_code == 200, r.text
                answers.append(name)

            async with asyncio.TaskGroup() as tg, holding_the_slot(to_a, other):
                for i in range(2):
                    tg.create_task(one(to_a, f"capped{i}", capped))
                await until_waiting(redis_prefix, 2)
                async with openai.AsyncOpenAI(
                    base_url=b.url + "/v1", api_key=capped, max_retries=0
                ) as client:
                    with pytest.raises(openai.RateLimitError) as refused:
                        await client.chat.completions.create(
                            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
                        )
                assert refused.value.code == "key_queue_full"
                assert int(refused.value.response.headers["retry-after"]) >= 1
                tg.create_task(one(to_b, "other", other))
                await until_waiting(redis_prefix, 3)  # accepted: it waits with the capped two

    asyncio.run(scenario())
    assert sorted(answers) == ["capped0", "capped1", "other"]


def test_a_waiting_stream_on_a_redis_router_hears_its_place_count_down(
    cluster: Cluster, redis_prefix: str
) -> None:
    key = new_key(cluster, "user")
    a = shared(cluster, redis_prefix, key, "--max-wait", "60")
    cluster.worker(a, "--slots", "1")
    a.wait_workers(1)
    lines: list[str] = []

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=a.url, timeout=120) as client:

            async def plain(tokens: int) -> None:
                r = await client.post("/v1/chat/completions", json=ask(tokens), headers=auth(key))
                assert r.status_code == 200, r.text

            async with asyncio.TaskGroup() as tg, holding_the_slot(client, key):
                for _ in range(2):
                    # wait ahead, each long enough (96 tokens: about a second) that the
                    # router's place snapshots (every 0.5 s) see the stream next in line
                    tg.create_task(plain(96))
                await until_waiting(redis_prefix, 2)

                heard = asyncio.Event()

                async def streamed() -> None:
                    body = {**ask(4), "stream": True}
                    async with client.stream(
                        "POST", "/v1/chat/completions", json=body, headers=auth(key)
                    ) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            lines.append(line)
                            heard.set()

                tg.create_task(streamed())
                await heard.wait()  # its first place; leaving the block frees the slot

    asyncio.run(scenario())
    lines = [line for line in lines if line]
    places = [int(line.split("=")[1]) for line in lines if line.startswith(": queued position=")]
    assert places[:1] == [2] and places[-1] == 0 and places == sorted(places, reverse=True), lines
    assert len(places) >= 2 and lines[-1] == "data: [DONE]", lines


def test_a_router_killed_holding_jobs_leaves_no_waiting_count_behind(
    cluster: Cluster, redis_prefix: str
) -> None:
    """Router A holds a job of the capped key and two wait; A is killed. Router B's worker
    runs them (B's sweep takes over A's job after the lease), the key's count goes back to
    zero, and the key may queue its two requests again."""
    capped = new_key(cluster, "capped", "--max-queued", "2")
    a = shared(cluster, redis_prefix, capped, "--queue-lease", "3")
    b = shared(cluster, redis_prefix, capped, "--queue-lease", "3")
    cluster.worker(a, "--slots", "1", name="on-a")
    a.wait_workers(1)
    b.wait_workers(1)  # b sees a's worker through Redis before it is asked

    async def flood_a() -> None:
        async with httpx.AsyncClient(base_url=a.url, timeout=120) as to_a:

            async def one(tokens: int) -> None:
                with contextlib.suppress(httpx.HTTPError):  # its router is killed under it
                    await to_a.post("/v1/chat/completions", json=ask(tokens), headers=auth(capped))

            async with asyncio.TaskGroup() as tg:
                tg.create_task(one(120))  # held by A, running on its worker
                await asyncio.to_thread(wait_until, lambda: running(redis_prefix), 30, "a job")
                for _ in range(2):
                    tg.create_task(one(8))
                await until_waiting(redis_prefix, 2)
                assert list(waiting_in_redis(redis_prefix).values()) == [2]  # all the key's
                a.proc.signal(signal.SIGKILL)

    asyncio.run(flood_a())
    cluster.worker(b, "--slots", "2", name="on-b")
    wait_until(lambda: total_waiting(redis_prefix) == 0 or None, 60, "the waiting jobs to run")
    wait_until(lambda: running(redis_prefix) == 0 or None, 60, "A's held job to be taken over")
    assert waiting_in_redis(redis_prefix) == {}

    async def again() -> list[int]:
        async with httpx.AsyncClient(base_url=b.url, timeout=120) as to_b:
            replies = await asyncio.gather(
                *(to_b.post("/v1/chat/completions", json=ask(4), headers=auth(capped))
                  for _ in range(2))
            )  # fmt: skip
            return [r.status_code for r in replies]

    assert asyncio.run(again()) == [200, 200]
