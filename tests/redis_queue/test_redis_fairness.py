"""Fair scheduling in Redis: the Lua scripts against the pure ``FairQueue``, on the real Redis.

``router/dispatch/fair_queue.py`` is the specification; the queue's scripts (``ENQUEUE``'s
start tags, ``TAKE``'s choice, ``SETTLE``, ``POSITIONS``) must give the same order and the
same places for any arrivals. Each hypothesis example gets its own key prefix.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.protocol.ids import JobId, ModelName, new_job_id
from shoal.protocol.messages import Endpoint
from shoal.redis_queue.keys import RedisKeys
from shoal.redis_queue.streams import BATCH_AGING_MS, RedisJobQueue
from shoal.redis_queue.support import JobStatus, KeyQueueFull, QueuedJob, Share
from shoal.router.dispatch.fair_queue import BATCH_AGING_S, FairQueue, Priority, Tenant

MODEL = ModelName("tiny")
CHAT = (MODEL, Endpoint.CHAT)
TENANTS = {
    "a": Tenant("a"),
    "b": Tenant("b", weight=3.0),
    "c": Tenant("c", weight=0.5),
    "n": Tenant("n", priority=Priority.BATCH),
}


def share(tenant: Tenant, work: float, *, fair: bool = True) -> Share:
    batch = tenant.priority is Priority.BATCH
    return Share(tenant.id, tenant.weight, batch, work, fair, tenant.max_queued)


def queued(job_id: JobId | None = None) -> QueuedJob:
    return QueuedJob(job_id or new_job_id(), MODEL, Endpoint.CHAT, True, {"n": 1})


@dataclass
class Pair:
    """One queue as two consumers see it: the router that enqueues and a worker."""

    router: RedisJobQueue
    worker: RedisJobQueue


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis(host="127.0.0.1", port=6379)
    yield r
    await r.aclose()


async def pair(r: aioredis.Redis, prefix: str) -> Pair:
    return Pair(
        RedisJobQueue(r, prefix, "router", lease_ms=5000, block_ms=100),
        RedisJobQueue(r, prefix, "worker", lease_ms=5000, block_ms=100),
    )


async def drop(r: aioredis.Redis, prefix: str) -> None:
    async for key in r.scan_iter(match=RedisKeys(prefix).pattern, count=500):
        await r.unlink(key)


def test_batch_aging_agrees_with_the_pure_queue() -> None:
    assert BATCH_AGING_MS == BATCH_AGING_S * 1000


push = st.tuples(st.just("push"), st.sampled_from(sorted(TENANTS)), st.integers(1, 400))
pop = st.tuples(st.just("pop"), st.integers(1, 3), st.just(0))
settle = st.tuples(st.just("settle"), st.sampled_from(sorted(TENANTS)), st.integers(0, 600))
ops = st.lists(st.one_of(push, push, pop, settle), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=ops, fair=st.booleans())
async def test_redis_order_and_places_equal_the_pure_fair_queue(
    ops: list[tuple[str, str | int, int]], fair: bool
) -> None:
    prefix = f"shoal-test-{uuid.uuid4().hex[:10]}:"
    redis_client = aioredis.Redis(host="127.0.0.1", port=6379)
    q = await pair(redis_client, prefix)
    pure: FairQueue[str] = FairQueue(10_000, fair=fair)
    work: dict[str, tuple[Tenant, float]] = {}
    try:
        for op, arg, n in ops:
            if op == "push":
                tenant = TENANTS[str(arg)]
                job = queued()
                await q.router.enqueue(job, share(tenant, n, fair=fair))
                pure.push(job.id, tenant, n, now=0)
                work[job.id] = (tenant, n)
            elif op == "pop":
                expected = []
                for _ in range(int(arg)):
                    if (head := pure.peek(now=0)) is None:
                        break
                    pure.pop(head)
                    expected.append(head)
                got = await q.worker.claim([CHAT], int(arg), block_ms=0)
                assert [c.job.id for c in got] == expected
            else:
                tenant = TENANTS[str(arg)]
                pure.settle(tenant, 100, n)
                await q.router.settle(*CHAT, share(tenant, 100), n)
        waiting = list(pure.jobs())
        places = await q.router.positions([JobId(j) for j in waiting])
        assert places == {j: pure.position(j, now=0) for j in waiting}
        counts = await q.router.waiting_by_key()
        assert counts == dict(pure.waiting_by_tenant())
    finally:
        await drop(redis_client, prefix)
        await redis_client.aclose()


async def test_a_key_over_its_cap_is_refused_until_one_of_its_jobs_leaves(
    redis_client: aioredis.Redis,
) -> None:
    prefix = f"shoal-test-{uuid.uuid4().hex[:10]}:"
    q = await pair(redis_client, prefix)
    capped = Tenant("capped", max_queued=2)
    try:
        first, second = queued(), queued()
        for j in (first, second):
            await q.router.enqueue(j, share(capped, 10))
        with pytest.raises(KeyQueueFull):
            await q.router.enqueue(queued(), share(capped, 10))
        assert await q.router.enqueue(queued(), share(TENANTS["a"], 10))  # others are not held
        assert await q.router.withdraw(first.id)
        assert await q.router.enqueue(queued(), share(capped, 10))
        assert (await q.router.waiting_by_key())["capped"] == 2
    finally:
        await drop(redis_client, prefix)


async def test_a_lost_holder_s_jobs_go_back_first_and_its_counts_follow(
    redis_client: aioredis.Redis,
) -> None:
    """A holder that died: its unstarted jobs wait again (first in their class, as a job put
    back in one router) and count as waiting for their key; claimed again, they do not."""
    prefix = f"shoal-test-{uuid.uuid4().hex[:10]}:"
    r = redis_client
    dead = RedisJobQueue(r, prefix, "dead", lease_ms=300, block_ms=100)
    router = RedisJobQueue(r, prefix, "router", lease_ms=300, block_ms=100)
    alive = RedisJobQueue(r, prefix, "alive", lease_ms=300, block_ms=100)
    try:
        held = [queued() for _ in range(2)]
        for j in held:
            await router.enqueue(j, share(TENANTS["a"], 10))
        assert len(await dead.claim([CHAT], 2, 0)) == 2
        assert await router.waiting_by_key() == {}
        later = queued()
        await router.enqueue(later, share(TENANTS["b"], 10))
        await asyncio.sleep(0.35)
        swept = await router.sweep()
        assert swept.requeued == 2
        assert await router.waiting_by_key() == {"a": 2, "b": 1}
        order = [c.job.id for c in await alive.claim([CHAT], 3, 0)]
        assert order[2] == later.id and set(order[:2]) == {j.id for j in held}
        assert await router.waiting_by_key() == {}
        assert await router.status(later.id) is JobStatus.RUNNING
    finally:
        await drop(r, prefix)


async def test_aged_batch_work_goes_with_interactive_work(redis_client: aioredis.Redis) -> None:
    prefix = f"shoal-test-{uuid.uuid4().hex[:10]}:"
    r = redis_client
    router = RedisJobQueue(r, prefix, "router", block_ms=100, batch_aging_ms=200)
    worker = RedisJobQueue(r, prefix, "worker", block_ms=100, batch_aging_ms=200)
    try:
        old = queued()
        await router.enqueue(old, share(TENANTS["n"], 10))
        fresh = queued()
        await router.enqueue(fresh, share(TENANTS["a"], 10))
        assert await router.positions([old.id, fresh.id]) == {fresh.id: 0, old.id: 1}
        await asyncio.sleep(0.25)
        await router.enqueue(queued(), share(TENANTS["a"], 10))
        # Aged, the batch job competes by its start tag: 0, like the first interactive one's
        # (which arrived after it).
        assert await router.positions([old.id, fresh.id]) == {old.id: 0, fresh.id: 1}
        assert [c.job.id for c in await worker.claim([CHAT], 2, 0)] == [old.id, fresh.id]
    finally:
        await drop(r, prefix)
