"""Holds on claiming (``redis_queue/claim.py``) against the real Redis at 127.0.0.1:6379: a
job held for one consumer is passed over by the others until its hold ends, and no longer.

Each test uses its own key prefix and deletes its keys afterwards; each queue has its own
client, so two queues stand for two routers, or for a router and pull workers (named as a
pull worker names its consumer: ``worker.redis_pull.consumer_name``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from shoal.jobs.events import Requeued
from shoal.protocol.ids import ModelName, new_job_id
from shoal.protocol.messages import Endpoint
from shoal.redis_queue.keys import RedisKeys
from shoal.redis_queue.streams import RedisJobQueue
from shoal.redis_queue.support import QueuedJob
from shoal.worker.link.redis_pull import consumer_name

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


# ---------------------------------------------------------------- context limits


def long_job(need: int) -> QueuedJob:
    return QueuedJob(new_job_id(), CHAT[0], CHAT[1], True, {}, need)


async def test_a_job_longer_than_a_claimers_context_waits_for_one_that_holds_it(
    queue: Factory,
) -> None:
    """A claimer passes over a job needing more context than its limit (and takes the one
    after it at once, without waiting on it as on a hold); a claimer with enough takes it,
    with its need."""
    small, big = queue("router-small"), queue("router-big")
    long, short = long_job(3600), long_job(900)
    await small.enqueue(long)
    await small.enqueue(short)
    started = time.monotonic()
    got = await small.claim([CHAT], 2, 1000, limits={CHAT: 2048})
    assert [c.job.id for c in got] == [short.id]
    assert await small.claim([CHAT], 1, 300, limits={CHAT: 2048}) == []
    assert time.monotonic() - started < 1.5  # blocked to its timeout, never spinning
    [claimed] = await big.claim([CHAT], 1, 100, limits={CHAT: 4096})
    assert claimed.job.id == long.id and claimed.job.need == 3600
    # no limit (a claimer whose worker does not say its context): anything
    again = long_job(100_000)
    await small.enqueue(again)
    assert [c.job.id for c in await small.claim([CHAT], 1, 100)] == [again.id]


async def test_a_job_given_back_needing_more_is_passed_over_by_its_old_claimer(
    queue: Factory,
) -> None:
    """A holder whose llama-server refused the prompt as too long gives the job back needing
    more: a claimer with as little context passes over it from then on; the need never
    falls, and the reader hears it (``Requeued.need``)."""
    small, big = queue("router-small"), queue("router-big")
    refused = long_job(1500)
    await small.enqueue(refused)
    [claimed] = await small.claim([CHAT], 1, 100, limits={CHAT: 2048})
    assert await small.requeue(claimed, "too long for its context", need=3527)
    assert await small.claim([CHAT], 1, 100, limits={CHAT: 2048}) == []
    [again] = await big.claim([CHAT], 1, 100, limits={CHAT: 4096})
    assert again.job.need == 3527 and again.attempt == 2
    assert await big.requeue(again, "its worker was lost", need=10)  # not lowered
    [third] = await big.claim([CHAT], 1, 100, limits={CHAT: 4096})
    assert third.job.need == 3527
    requeued: list[Requeued] = []
    with contextlib.suppress(TimeoutError):  # a job still running has no final event
        async with asyncio.timeout(1.0):
            async for delivered in small.events(refused.id, block_ms=100):
                if isinstance(delivered.event, Requeued):
                    requeued.append(delivered.event)
    assert [r.need for r in requeued] == [3527, 10]
