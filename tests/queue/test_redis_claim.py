"""Holds on claiming (``queue/redis_claim.py``) against the real Redis at 127.0.0.1:6379: a
job held for one consumer is passed over by the others until its hold ends, and no longer.

Each test uses its own key prefix and deletes its keys afterwards; each queue has its own
client, so two queues stand for two routers, or for a router and pull workers (named as a
pull worker names its consumer: ``worker.redis_pull.consumer_name``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from shoal.protocol.ids import ModelName, new_job_id
from shoal.protocol.messages import Endpoint
from shoal.queue.redis_keys import RedisKeys
from shoal.queue.redis_streams import RedisJobQueue
from shoal.queue.redis_support import QueuedJob
from shoal.worker.redis_pull import consumer_name

CHAT = (ModelName("tiny"), Endpoint.CHAT)
HOLD_MS = 600

Factory = Callable[[str], RedisJobQueue]


@pytest.fixture
async def queue() -> AsyncIterator[Factory]:
    prefix = f"shoal-test-{uuid.uuid4().hex[:10]}:"
    clients: list[aioredis.Redis] = []

    def make(consumer: str) -> RedisJobQueue:
        clients.append(aioredis.Redis(host="127.0.0.1", port=6379))
        return RedisJobQueue(clients[-1], prefix, consumer, lease_ms=3000, block_ms=3000)

    yield make
    async for key in clients[0].scan_iter(match=RedisKeys(prefix).pattern, count=500):
        await clients[0].unlink(key)
    for c in clients:
        await c.aclose()


def job() -> QueuedJob:
    return QueuedJob(id=new_job_id(), model=CHAT[0], endpoint=CHAT[1], stream=True, body={})


async def test_a_held_job_waits_for_its_router_then_anyone_takes_it(queue: Factory) -> None:
    a, b = queue("router-a"), queue("router-b")
    held, free = job(), job()
    await a.enqueue(held, hold=("router-b", HOLD_MS))
    await a.enqueue(free)
    started = time.monotonic()
    # Router A passes over the job held for B and takes the one after it.
    assert [c.job.id for c in await a.claim([CHAT], 2, 100)] == [free.id]
    # Blocked, A is back as the hold ends (not at its block timeout) and takes it then.
    assert await a.claim([CHAT], 1, 3000) == []
    waited = time.monotonic() - started
    assert HOLD_MS / 1000 - 0.1 <= waited < HOLD_MS / 1000 + 1.0, waited
    assert [c.job.id for c in await a.claim([CHAT], 1, 100)] == [held.id]
    assert await b.claim([CHAT], 1, 100) == []


async def test_the_router_a_job_is_held_for_takes_it_at_once(queue: Factory) -> None:
    a, b = queue("router-a"), queue("router-b")
    blocked = [asyncio.ensure_future(q.claim([CHAT], 1, 2000)) for q in (a, b)]
    await asyncio.sleep(0.2)  # both blocked on the queue's wake-up stream
    started = time.monotonic()
    held = job()
    await a.enqueue(held, hold=("router-b", 10_000))
    got_b = await blocked[1]
    assert [c.job.id for c in got_b] == [held.id]
    assert time.monotonic() - started < 0.5  # woken by the job's arrival
    assert await blocked[0] == []


async def test_a_held_job_put_back_is_anyone_s(queue: Factory) -> None:
    a, b = queue("router-a"), queue("router-b")
    held = job()
    await a.enqueue(held, hold=("router-b", 10_000))
    [claimed] = await b.claim([CHAT], 1, 100)
    assert await b.requeue(claimed, "its worker was lost")
    assert [c.job.id for c in await a.claim([CHAT], 1, 100)] == [held.id]


async def test_a_job_held_for_a_pull_worker_is_taken_by_it_at_once(queue: Factory) -> None:
    router, p1, p2 = queue("router-a"), queue(consumer_name("p1")), queue(consumer_name("p2"))
    claimers = (router, p1, p2)
    blocked = [asyncio.ensure_future(q.claim([CHAT], 1, 2000)) for q in claimers]
    await asyncio.sleep(0.2)  # all blocked on the queue's wake-up stream
    started = time.monotonic()
    held = job()
    await router.enqueue(held, hold=(p1.consumer, 10_000))
    assert [c.job.id for c in await blocked[1]] == [held.id]
    assert time.monotonic() - started < 0.5  # woken by the job's arrival, as a router is
    assert await blocked[0] == [] and await blocked[2] == []


async def test_a_job_held_for_a_pull_worker_waits_for_it_then_anyone_takes_it(
    queue: Factory,
) -> None:
    router, p1, p2 = queue("router-a"), queue(consumer_name("p1")), queue(consumer_name("p2"))
    held = job()
    await router.enqueue(held, hold=(p1.consumer, HOLD_MS))
    started = time.monotonic()
    # The router and the other pull worker pass it over (p1 is busy and does not claim).
    assert await router.claim([CHAT], 1, 100) == []
    assert await p2.claim([CHAT], 1, 100) == []
    # Blocked, p2 is back as the hold ends (not at its block timeout), and takes it then.
    assert await p2.claim([CHAT], 1, 3000) == []
    waited = time.monotonic() - started
    assert HOLD_MS / 1000 - 0.1 <= waited < HOLD_MS / 1000 + 1.0, waited
    assert [c.job.id for c in await p2.claim([CHAT], 1, 100)] == [held.id]
    assert await p1.claim([CHAT], 1, 100) == []
