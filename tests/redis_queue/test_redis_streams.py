"""The Redis job queue against the real Redis at 127.0.0.1:6379 (and a private one to restart).

Each test gets its own key prefix and deletes its keys afterwards (SCAN MATCH + UNLINK,
never KEYS). Each ``RedisJobQueue`` made by the ``queue`` fixture has its own client, so two
of them stand for two processes (routers or pull workers). A consumer "dies" by no longer
renewing its leases; the restart test runs its own ``redis-server`` with an append-only file
in a temp dir, because the shared one must stay up for everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from redis_server import OwnRedis, free_port, own_redis_server
from shoal.jobs import events
from shoal.jobs.events import (
    Assigned,
    Data,
    Delivered,
    Done,
    Failed,
    JobEvent,
    Loading,
    Requeued,
    Result,
    Trail,
)
from shoal.protocol.ids import JobId, ModelName, new_job_id
from shoal.protocol.messages import Continuation, Endpoint, ErrorBody
from shoal.redis_queue.claimed import Claimed
from shoal.redis_queue.consumer import coalesce
from shoal.redis_queue.keys import GROUP, RedisKeys
from shoal.redis_queue.streams import RedisJobQueue
from shoal.redis_queue.support import (
    JobGone,
    JobStatus,
    Lease,
    QueueCounts,
    QueuedJob,
    QueueFull,
    Sweep,
    retrying,
)
from shoal.redis_queue.tail import OutputTail

MODEL = ModelName("tiny")
CHAT = (MODEL, Endpoint.CHAT)
COMPLETIONS = (MODEL, Endpoint.COMPLETIONS)
LEASE_MS = 300

Factory = Callable[..., RedisJobQueue]


def client(port: int = 6379, **kwargs: Any) -> aioredis.Redis:
    return aioredis.Redis(host="127.0.0.1", port=port, **kwargs)


async def delete_prefix(r: aioredis.Redis, prefix: str) -> None:
    async for key in r.scan_iter(match=RedisKeys(prefix).pattern, count=500):
        await r.unlink(key)


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    prefix = f"shoal-test-{uuid.uuid4().hex[:10]}:"
    yield prefix
    r = client()
    try:
        await delete_prefix(r, prefix)
    finally:
        await r.aclose()


@pytest.fixture
async def queue(prefix: str) -> AsyncIterator[Factory]:
    """Makes queues, one Redis client each (one process each), all closed afterwards."""
    clients: list[aioredis.Redis] = []

    def make(consumer: str, port: int = 6379, redis_kwargs: Any = None, **kw: Any) -> RedisJobQueue:
        clients.append(client(port, **(redis_kwargs or {})))
        kw.setdefault("lease_ms", LEASE_MS)
        kw.setdefault("block_ms", 500)
        return RedisJobQueue(clients[-1], prefix, consumer, **kw)

    yield make
    for c in clients:
        await c.aclose()


def job(endpoint: Endpoint = Endpoint.CHAT, **body: Any) -> QueuedJob:
    return QueuedJob(
        id=new_job_id(), model=MODEL, endpoint=endpoint, stream=True, body=body or {"n": 1}
    )


async def read_all(q: RedisJobQueue, job_id: JobId, last_id: str = "0") -> list[JobEvent]:
    async with asyncio.timeout(5):
        return [d.event async for d in q.events(job_id, last_id)]


async def claim_one(q: RedisJobQueue, keys: Any = (CHAT,), block_ms: int = 500) -> Claimed:
    got = await q.claim(list(keys), 1, block_ms)
    assert len(got) == 1, got
    return got[0]


def outputs(evs: list[JobEvent]) -> list[JobEvent]:
    return [e for e in evs if not isinstance(e, Assigned | Requeued)]


# ---------------------------------------------------------------- the happy path


async def test_round_trip(queue: Factory) -> None:
    router, worker = queue("router-1"), queue("worker-1")
    j = job(messages=[{"role": "user", "content": "hi"}])
    assert await router.enqueue(j)
    assert await router.counts(*CHAT) == QueueCounts(waiting=1, running=0)

    claimed = await claim_one(worker)
    assert claimed.job == j
    assert claimed.attempt == 1
    assert await router.counts(*CHAT) == QueueCounts(waiting=0, running=1)
    assert await router.status(j.id) is JobStatus.RUNNING

    leases = await worker.publish_many(
        [(claimed, Data('{"x":1}')), (claimed, Data('{"x":2}')), (claimed, Done())]
    )
    assert leases == {j.id: Lease.HELD}
    assert await read_all(router, j.id) == [
        Assigned("worker-1", 1),
        Data('{"x":1}'),
        Data('{"x":2}'),
        Done(),
    ]
    # The final event ended the job and acknowledged it: nothing waits or runs any more.
    assert await router.status(j.id) is JobStatus.SUCCEEDED
    assert await router.depth(*CHAT) == 0
    assert await worker.ack(claimed)  # acking again is harmless
    assert await worker.reclaim([CHAT], 0) == []


async def test_result_job(queue: Factory) -> None:
    router, worker = queue("router-1"), queue("worker-1")
    j = job(Endpoint.EMBEDDINGS, input="abc")
    await router.enqueue(j)
    claimed = await claim_one(worker, [(MODEL, Endpoint.EMBEDDINGS)])
    assert claimed.job.body == {"input": "abc"} and claimed.job.endpoint is Endpoint.EMBEDDINGS
    assert await worker.publish(claimed, Result('{"data":[]}')) is Lease.HELD
    assert outputs(await read_all(router, j.id)) == [Result('{"data":[]}')]
    assert await router.status(j.id) is JobStatus.SUCCEEDED


async def test_enqueue_is_idempotent_by_job_id(queue: Factory) -> None:
    router, other_router, worker = queue("r1"), queue("r2"), queue("w1")
    j = job()
    assert await router.enqueue(j) is True
    assert await other_router.enqueue(j) is False
    assert await router.depth(*CHAT) == 1
    assert (await claim_one(worker)).job.id == j.id
    assert await worker.claim([CHAT], 5, 100) == []


async def test_failed_event_carries_the_error(queue: Factory) -> None:
    router, worker = queue("r1"), queue("w1")
    j = job()
    await router.enqueue(j)
    claimed = await claim_one(worker)
    error = ErrorBody(message="context too long", type="invalid_request_error", code=None)
    assert await worker.publish(claimed, Failed(400, error)) is Lease.HELD
    assert outputs(await read_all(router, j.id)) == [Failed(400, error)]
    assert await router.status(j.id) is JobStatus.FAILED
    assert await router.depth(*CHAT) == 0


# ---------------------------------------------------------------- claiming


async def test_two_consumers_never_get_the_same_job(queue: Factory) -> None:
    router = queue("r1")
    ids = {j.id for j in [job() for _ in range(60)] if await router.enqueue(j)}
    got: dict[str, list[JobId]] = {"w1": [], "w2": []}

    async def consume(name: str) -> None:
        q = queue(name)
        while claims := await q.claim([CHAT], 3, 100):
            got[name] += [c.job.id for c in claims]

    await asyncio.gather(consume("w1"), consume("w2"))
    assert not set(got["w1"]) & set(got["w2"])
    assert sorted(got["w1"] + got["w2"]) == sorted(ids)
    assert got["w1"] and got["w2"]


async def test_blocked_consumers_wake_once_per_job(queue: Factory) -> None:
    router, w1, w2 = queue("r1"), queue("w1"), queue("w2")
    waiting = [asyncio.ensure_future(w.claim([CHAT], 1, 1500)) for w in (w1, w2)]
    await asyncio.sleep(0.2)  # both are now blocked on the queue's wake-up stream
    started = time.monotonic()
    j = job()
    await router.enqueue(j)
    done, pending = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    assert time.monotonic() - started < 0.5  # woken by the job, not by the block timeout
    winner = done.pop().result()
    assert [c.job.id for c in winner] == [j.id]
    assert await pending.pop() == []  # the other one timed out empty-handed


async def test_claim_takes_oldest_first_across_queues_and_respects_count(queue: Factory) -> None:
    router, worker = queue("r1"), queue("w1")
    jobs = [job(Endpoint.CHAT), job(Endpoint.COMPLETIONS), job(Endpoint.COMPLETIONS), job()]
    for j in jobs:
        await router.enqueue(j)
        await asyncio.sleep(0.002)  # entry ids order jobs across queues to the millisecond
    order = []
    for _ in jobs:
        claims = await worker.claim([CHAT, COMPLETIONS], 1, 100)
        assert len(claims) == 1
        order.append(claims[0].job.id)
    assert order == [j.id for j in jobs]


async def test_a_blocked_claim_wakes_for_a_job_in_any_of_its_queues(queue: Factory) -> None:
    router, worker = queue("r1"), queue("w1")
    blocked = asyncio.ensure_future(worker.claim([CHAT, COMPLETIONS], 2, 1500))
    await asyncio.sleep(0.2)  # blocked on both wake-up streams now
    started = time.monotonic()
    j = job(Endpoint.COMPLETIONS)
    await router.enqueue(j)
    assert [c.job.id for c in await blocked] == [j.id]
    assert time.monotonic() - started < 0.5  # woken by the job, not by the block timeout


# ---------------------------------------------------------------- leases and recovery


async def test_renewed_lease_is_kept(queue: Factory) -> None:
    router, w1, w2 = queue("r1"), queue("w1"), queue("w2")
    await router.enqueue(job())
    claimed = await claim_one(w1)
    for _ in range(6):  # 600 ms, twice the lease
        await asyncio.sleep(LEASE_MS / 3000)
        assert await claimed.renew() is Lease.HELD
    assert await w2.reclaim([CHAT], count=5) == []


async def test_dead_holder_without_output_is_run_again(queue: Factory) -> None:
    router, dead, alive = queue("r1"), queue("dead"), queue("alive")
    j = job()
    await router.enqueue(j)
    lost = await claim_one(dead)
    assert await alive.reclaim([CHAT], count=5) == []  # not idle long enough yet
    await asyncio.sleep(LEASE_MS / 1000 + 0.05)

    (again,) = await alive.reclaim([CHAT], count=5)
    assert again.job == j and again.attempt == 2
    # The old holder is fenced off: it cannot answer for a job it no longer holds.
    assert await dead.publish(lost, Data("stale")) is Lease.LOST
    assert await lost.renew() is Lease.LOST
    assert not await dead.ack(lost)

    await alive.publish_many([(again, Data("fresh")), (again, Done())])
    assert await read_all(router, j.id) == [
        Assigned("dead", 1),
        Assigned("alive", 2),
        Data("fresh"),
        Done(),
    ]


async def test_dead_holder_after_output_fails_the_job(queue: Factory) -> None:
    router, dead, alive = queue("r1"), queue("dead"), queue("alive")
    j = job()
    await router.enqueue(j)
    lost = await claim_one(dead)
    await dead.publish(lost, Data("partial"))
    await asyncio.sleep(LEASE_MS / 1000 + 0.05)

    assert await alive.reclaim([CHAT], count=5) == []  # not run again
    evs = outputs(await read_all(router, j.id))
    assert evs[0] == Data("partial")
    assert isinstance(evs[1], Failed) and evs[1].status == 502
    assert "lost after it had started answering" in evs[1].error.message
    assert len(evs) == 2
    assert await router.status(j.id) is JobStatus.FAILED
    assert await router.depth(*CHAT) == 0
    assert await dead.publish(lost, Done()) is Lease.LOST


async def test_consumer_dead_between_take_and_hand_over(queue: Factory) -> None:
    """Taken by a claim script for a consumer that died before it read the reply: the job
    runs elsewhere after the lease, and a cancelled one is not run."""
    router, ghost, alive = queue("r1"), queue("ghost"), queue("alive")
    kept, cancelled = job(), job()
    for j in (kept, cancelled):
        await router.enqueue(j)
    taken, _, _ = await ghost._take([ghost.keys.queue_keys(*CHAT)], 5)
    assert len(taken) == 2
    assert await router.cancel(cancelled.id) is JobStatus.RUNNING
    await asyncio.sleep(LEASE_MS / 1000 + 0.05)
    (again,) = await alive.reclaim([CHAT], count=5)
    assert again.job.id == kept.id and again.attempt == 2
    assert await router.counts(*CHAT) == QueueCounts(waiting=0, running=1)


async def test_adopt_moves_a_running_job_keeping_its_output(queue: Factory) -> None:
    router, router_a, router_b = queue("r1"), queue("ra"), queue("rb")
    j = job()
    await router.enqueue(j)
    via_a = await claim_one(router_a)
    await router_a.publish(via_a, Data("1"))
    # Router A died; its worker reconnects to router B, which takes the job over.
    assert await router_b.adopt(j.id, attempt=2) is None  # not the run this worker has
    via_b = await router_b.adopt(j.id, attempt=1)
    assert via_b is not None and via_b.seq == via_a.seq == 1 and via_b.attempt == 1
    assert await router_a.publish(via_a, Data("stale")) is Lease.LOST
    await router_b.publish_many([(via_b, Data("2")), (via_b, Done())])
    assert outputs(await read_all(router, j.id)) == [Data("1"), Data("2"), Done()]
    assert await router_b.adopt(j.id, attempt=1) is None  # finished: nothing to adopt
    assert await router.depth(*CHAT) == 0


async def test_requeue_hands_the_job_to_another_consumer(queue: Factory) -> None:
    router, w1, w2 = queue("r1"), queue("w1"), queue("w2")
    j = job()
    await router.enqueue(j)
    first = await claim_one(w1)
    assert await w1.requeue(first, "backend restarting")
    second = await claim_one(w2)
    assert second.job.id == j.id and second.attempt == 2
    assert await w1.publish(first, Data("stale")) is Lease.LOST
    await w2.publish(second, Data("x"))
    assert not await w2.requeue(second, "too late: it answered")
    await w2.publish(second, Done())
    assert await read_all(router, j.id) == [
        Assigned("w1", 1),
        Requeued("backend restarting"),
        Assigned("w2", 2),
        Data("x"),
        Done(),
    ]


async def test_sweep_puts_back_or_fails_orphans(queue: Factory) -> None:
    router, dead, worker = queue("r1"), queue("dead"), queue("w1")
    unstarted, started = job(), job()
    for j in (unstarted, started):
        await router.enqueue(j)
    a, b = await dead.claim([CHAT], 2, 100)
    held = {a.job.id: a, b.job.id: b}
    await dead.publish(held[started.id], Data("partial"))
    await asyncio.sleep(LEASE_MS / 1000 + 0.05)

    swept = await router.sweep()
    assert (swept.failed, swept.requeued) == (1, 1)
    assert await router.status(started.id) is JobStatus.FAILED
    assert (await claim_one(worker)).job.id == unstarted.id
    assert Requeued("the worker holding this job was lost before it answered") in await _events_now(
        router, unstarted.id
    )


async def _events_now(q: RedisJobQueue, job_id: JobId) -> list[JobEvent]:
    evs: list[JobEvent] = []
    async for d in q.events(job_id, block_ms=50):
        evs.append(d.event)
        if isinstance(d.event, Assigned) and d.event.attempt == 2:
            break
    return evs


async def test_ack_of_an_unfinished_job_fails_it(queue: Factory) -> None:
    router, worker = queue("r1"), queue("w1")
    j = job()
    await router.enqueue(j)
    claimed = await claim_one(worker)
    assert await worker.ack(claimed)
    (failed,) = outputs(await read_all(router, j.id))
    assert isinstance(failed, Failed) and failed.status == 500
    assert await router.depth(*CHAT) == 0


async def test_a_resent_publish_is_written_once(queue: Factory) -> None:
    router, worker = queue("r1"), queue("w1")
    j = job()
    await router.enqueue(j)
    claimed = await claim_one(worker)
    await worker.publish(claimed, Data("a"))
    claimed.seq -= 1  # as if the same call reached Redis twice
    assert await worker.publish(claimed, Data("a")) is Lease.HELD
    await worker.publish(claimed, Done())
    assert outputs(await read_all(router, j.id)) == [Data("a"), Done()]


async def test_the_worker_running_a_job_is_published_unnumbered(queue: Factory) -> None:
    """A consumer names the worker it runs a job on: not an output event, so it takes no
    sequence number (chunk numbers stay what a resuming worker counts), and only the job's
    holder may say it."""
    router, worker, other = queue("r1"), queue("w1"), queue("w2")
    j = job()
    await router.enqueue(j)
    claimed = await claim_one(worker)
    assert await worker.publish(claimed, Assigned("w1", 1, "gpu-1")) is Lease.HELD
    assert claimed.seq == 0
    await worker.publish(claimed, Data("a"))
    assert claimed.seq == 1
    stolen = Claimed(claimed.job, claimed.entry_id, claimed.attempt, other)
    assert await other.publish(stolen, Assigned("w2", 1, "gpu-2")) is Lease.LOST
    await worker.publish(claimed, Done())
    assert await read_all(router, j.id) == [
        Assigned("w1", 1),
        Assigned("w1", 1, "gpu-1"),
        Data("a"),
        Done(),
    ]


async def test_a_models_load_is_published_unnumbered(queue: Factory) -> None:
    """``Loading`` (the job waits while its worker loads its model) is not output: no
    sequence number (a resuming worker's chunk count stays right), and the job may still
    run again after it."""
    router, worker = queue("r1"), queue("w1")
    j = job()
    await router.enqueue(j)
    claimed = await claim_one(worker)
    assert await worker.publish(claimed, Loading("m")) is Lease.HELD
    assert claimed.seq == 0
    assert await worker.requeue(claimed, "backend restarting")
    again = await claim_one(worker)
    await worker.publish(again, Data("a"))
    await worker.publish(again, Done())
    evs = await read_all(router, j.id)
    assert Loading("m") in evs and evs[-2:] == [Data("a"), Done()]


# ---------------------------------------------------------------- cancel, bound, events


async def test_cancel_while_waiting(queue: Factory) -> None:
    router, worker = queue("r1"), queue("w1")
    j, other = job(), job()
    await router.enqueue(j)
    await router.enqueue(other)
    assert await router.cancel(j.id) is JobStatus.WAITING
    assert await router.status(j.id) is JobStatus.CANCELLED
    assert await router.depth(*CHAT) == 1
    assert [c.job.id for c in await worker.claim([CHAT], 5, 100)] == [other.id]
    assert await router.cancel(j.id) is JobStatus.CANCELLED  # again: nothing to do
    assert await router.cancel(JobId("job_nope")) is JobStatus.MISSING


async def test_withdraw_leaves_running_jobs_alone(queue: Factory) -> None:
    router, worker = queue("r1"), queue("w1")
    waiting, running = job(), job()
    await router.enqueue(running)
    claimed = await claim_one(worker)
    await router.enqueue(waiting)
    assert await router.withdraw(waiting.id)
    assert not await router.withdraw(running.id)
    assert await claimed.renew() is Lease.HELD


async def test_cancel_while_running(queue: Factory) -> None:
    router, worker = queue("r1"), queue("w1")
    j = job()
    await router.enqueue(j)
    claimed = await claim_one(worker)
    await worker.publish(claimed, Data("a"))

    stream = worker.cancellations(block_ms=1000)
    try:
        assert await router.cancel(j.id) is JobStatus.RUNNING
        async with asyncio.timeout(2):
            assert await anext(stream) == j.id
    finally:
        await stream.aclose()
    assert await worker.publish(claimed, Data("b")) is Lease.CANCELLED
    assert await claimed.renew() is Lease.CANCELLED
    assert await worker.ack(claimed)
    assert await router.status(j.id) is JobStatus.CANCELLED
    assert await router.depth(*CHAT) == 0


async def test_queue_bound_counts_waiting_and_running(queue: Factory) -> None:
    router, worker = queue("r1", max_len=2), queue("w1")
    await router.enqueue(job())
    await router.enqueue(job())
    with pytest.raises(QueueFull, match="limit is 2"):
        await router.enqueue(job())
    claimed = await claim_one(worker)
    with pytest.raises(QueueFull):
        await router.enqueue(job())  # a running job still counts
    await worker.publish(claimed, Done())
    assert await router.enqueue(job())
    assert await router.depth(*CHAT) == 2
    assert await router.enqueue(job(Endpoint.COMPLETIONS))  # another queue, its own bound


async def test_events_resume_from_an_id(queue: Factory) -> None:
    router, worker = queue("r1"), queue("w1")
    j = job()
    await router.enqueue(j)
    claimed = await claim_one(worker)
    await worker.publish_many([(claimed, Data(str(i))) for i in range(5)])

    seen: list[Delivered] = []
    async for d in router.events(j.id):
        seen.append(d)
        if len(seen) == 3:  # Assigned, 0, 1: then the client's connection breaks
            break
    reader = asyncio.ensure_future(read_all(router, j.id, last_id=seen[-1].id))
    await asyncio.sleep(0.1)  # the resumed reader is blocked waiting for more
    await worker.publish_many([(claimed, Data("5")), (claimed, Done())])
    rest = await reader
    assert [e.event for e in seen[1:]] + rest == [Data(str(i)) for i in range(6)] + [Done()]


async def test_events_of_a_job_that_is_gone(queue: Factory) -> None:
    router = queue("r1")
    with pytest.raises(JobGone):
        await read_all(router, JobId("job_never_queued"))


async def test_names_that_would_break_key_names_are_refused(queue: Factory) -> None:
    with pytest.raises(ValueError, match="cannot be used in a Redis key"):
        queue("bad:name")
    with pytest.raises(ValueError, match="cannot be used in a Redis key"):
        await queue("r1").enqueue(QueuedJob(JobId("a:b"), MODEL, Endpoint.CHAT, False, {}))


# ---------------------------------------------------------------- Redis restarted mid-job


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    with own_redis_server(tmp_path) as server:
        yield server


async def test_redis_restarted_mid_job(queue: Factory, own_redis: OwnRedis) -> None:
    no_retry = {"retry": Retry(NoBackoff(), 0)}
    port = own_redis.port
    router = queue("r1", port=port, outage_s=0, redis_kwargs=no_retry)
    worker = queue("w1", port=port, outage_s=0, redis_kwargs=no_retry)
    patient = queue("w1", port=port, outage_s=15, redis_kwargs=no_retry)  # same consumer
    j = job()
    await router.enqueue(j)
    claimed = await claim_one(worker, block_ms=200)
    await worker.publish_many([(claimed, Data("before-1")), (claimed, Data("before-2"))])

    await asyncio.to_thread(own_redis.stop)
    with pytest.raises(redis.exceptions.ConnectionError):
        await worker.publish(claimed, Data("while-down"))

    async def restart_soon() -> None:
        await asyncio.sleep(0.5)
        await asyncio.to_thread(own_redis.start)

    restarting = asyncio.ensure_future(restart_soon())
    # A patient call rides out the outage and lands once Redis is back.
    claimed.queue = patient
    assert await patient.publish(claimed, Data("after-1")) is Lease.HELD
    await restarting
    assert await retrying(lambda: claimed.renew(), deadline_s=5) is Lease.HELD
    await retrying(lambda: worker.publish(claimed, Done()), deadline_s=5)

    evs = await retrying(lambda: read_all(router, j.id), deadline_s=5)
    assert outputs(evs) == [Data("before-1"), Data("before-2"), Data("after-1"), Done()]
    assert await router.status(j.id) is JobStatus.SUCCEEDED
    assert await router.depth(*CHAT) == 0


async def test_no_take_over_within_a_lease_of_an_outage(
    queue: Factory, own_redis: OwnRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """Nobody could renew while Redis was down: a sweep right after it takes nothing over,
    and the outage is logged once as it starts and once as it ends."""
    no_retry = {"retry": Retry(NoBackoff(), 0)}
    port = own_redis.port
    holder = queue("w1", port=port, outage_s=0, redis_kwargs=no_retry)
    sweeper = queue("r1", port=port, outage_s=15, redis_kwargs=no_retry)
    j = job()
    await holder.enqueue(j)
    claimed = await claim_one(holder, block_ms=200)
    await holder.publish(claimed, Data("started"))
    await asyncio.to_thread(own_redis.stop)
    sweeping = asyncio.ensure_future(sweeper.sweep())  # rides out the outage
    await asyncio.sleep(LEASE_MS / 1000 * 2)  # the lease runs out while Redis is away
    await asyncio.to_thread(own_redis.start)
    assert await sweeping == Sweep()
    assert await sweeper.status(j.id) is JobStatus.RUNNING
    await asyncio.sleep(LEASE_MS / 1000 + 0.05)  # a lease after the outage: the holder is dead
    assert (await sweeper.sweep()).failed == 1
    logged = [
        r.getMessage()
        for r in caplog.records
        if r.name.endswith("redis_queue.support") and r.levelno > logging.DEBUG
    ]
    assert len(logged) == 2, logged
    assert logged[0].startswith("Redis unreachable (sweep: ")
    assert logged[1].startswith("Redis reachable again after ")


async def test_calls_raise_connection_error_while_redis_is_down(queue: Factory) -> None:
    port = free_port()  # nothing listens here
    q = queue("r1", port=port, outage_s=0.3, redis_kwargs={"retry": Retry(NoBackoff(), 0)})
    started = time.monotonic()
    with pytest.raises(redis.exceptions.ConnectionError):
        await q.enqueue(job())
    assert 0.3 <= time.monotonic() - started < 3  # retried for outage_s, then gave up


# ---------------------------------------------------------------- one reader for many jobs


@contextlib.asynccontextmanager
async def running_tail(port: int = 6379, prefix: str = "", **kw: Any) -> AsyncIterator[OutputTail]:
    r = client(port, retry=Retry(NoBackoff(), 0))
    tail = OutputTail(r, prefix, "router-1", **kw)
    task = asyncio.ensure_future(tail.run())
    try:
        yield tail
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await r.aclose()


async def read_tail(tail: OutputTail, job_id: JobId, last_id: str = "0") -> list[JobEvent]:
    async with asyncio.timeout(5):
        return [d.event async for d in tail.events(job_id, last_id)]


async def test_tail_reads_many_jobs_through_one_reader(queue: Factory, prefix: str) -> None:
    router, worker = queue("r1"), queue("w1")
    jobs = [job() for _ in range(20)]
    for j in jobs:
        await router.enqueue(j)
    async with running_tail(prefix=prefix, block_ms=1500) as tail:
        await asyncio.sleep(0.1)  # the reader is blocked with nothing to read
        started = time.monotonic()
        readers = [asyncio.ensure_future(read_tail(tail, j.id)) for j in jobs]
        claims = await worker.claim([CHAT], 20, 100)
        items: list[tuple[Claimed, Any]] = []
        for n in range(3):
            items += [(c, Data(f"{c.job.id}:{n}")) for c in claims]
        await worker.publish_many(items + [(c, Done()) for c in claims])
        results = await asyncio.gather(*readers)
        assert time.monotonic() - started < 1.0  # new watches woke the blocked reader
    for j, evs in zip(jobs, results, strict=True):
        assert outputs(evs) == [Data(f"{j.id}:{n}") for n in range(3)] + [Done()]


async def _first_n(it: AsyncIterator[Delivered], n: int) -> list[Delivered]:
    got: list[Delivered] = []
    try:
        async for d in it:
            got.append(d)
            if len(got) == n:
                break
    finally:
        await it.aclose()  # type: ignore[attr-defined]  # an async generator
    return got


async def test_tail_resumes_from_an_id_and_reports_gone_jobs(queue: Factory, prefix: str) -> None:
    router, worker = queue("r1"), queue("w1")
    j = job()
    await router.enqueue(j)
    claimed = await claim_one(worker)
    await worker.publish_many([(claimed, Data("a")), (claimed, Data("b"))])
    async with running_tail(prefix=prefix, block_ms=200) as tail:
        async with asyncio.timeout(5):
            first = await _first_n(tail.events(j.id), 3)
        assert [d.event for d in first] == [Assigned("w1", 1), Data("a"), Data("b")]
        await worker.publish_many([(claimed, Data("c")), (claimed, Done())])
        assert await read_tail(tail, j.id, first[-1].id) == [Data("c"), Done()]
        with pytest.raises(JobGone):
            await read_tail(tail, JobId("job_never_queued"))


async def test_tail_rides_out_a_redis_restart(queue: Factory, own_redis: OwnRedis) -> None:
    no_retry = {"retry": Retry(NoBackoff(), 0)}
    router = queue("r1", port=own_redis.port, outage_s=0, redis_kwargs=no_retry)
    worker = queue("w1", port=own_redis.port, outage_s=0, redis_kwargs=no_retry)
    j = job()
    await router.enqueue(j)
    claimed = await claim_one(worker, block_ms=200)
    await worker.publish(claimed, Data("a"))
    async with running_tail(own_redis.port, router.keys.prefix, block_ms=300) as tail:
        reader = asyncio.ensure_future(read_tail(tail, j.id))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(own_redis.stop)
        await asyncio.sleep(0.3)  # the reader fails and backs off meanwhile
        await asyncio.to_thread(own_redis.start)
        await retrying(lambda: worker.publish(claimed, Data("b")), deadline_s=5)
        await retrying(lambda: worker.publish(claimed, Done()), deadline_s=5)
        assert await reader == [Assigned("w1", 1), Data("a"), Data("b"), Done()]


async def test_loops_over_queue_calls_stop_when_cancelled(queue: Factory, prefix: str) -> None:
    """Loops over queue calls end when cancelled (see ``raise_if_cancelled``; the tail test
    above is the one that hung without it: its reader is cancelled right after waking)."""
    router, worker = queue("r1"), queue("w1")
    for _ in range(3):
        await router.enqueue(job())
    silent = job(Endpoint.COMPLETIONS)  # nobody claims it: its output stays empty
    await router.enqueue(silent)

    async def claim_forever() -> None:
        while True:  # claims fast, then blocks in short reads
            await worker.claim([CHAT], 1, 50)

    async def read_forever() -> None:
        async for _ in router.events(silent.id, block_ms=50):
            pass

    for body in (claim_forever, read_forever):
        task = asyncio.ensure_future(body())
        await asyncio.sleep(0.3)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2)
        assert done, f"{body.__name__} ignored its cancellation"
        assert task.cancelled()


async def test_prune_removes_only_idle_consumers_holding_nothing(queue: Factory) -> None:
    router, holder, idle = queue("r1"), queue("holder"), queue("idle")
    await router.enqueue(job())
    await router.enqueue(job())
    held = await claim_one(holder)
    done = await claim_one(idle)
    await idle.publish(done, Done())  # "idle" is now a consumer holding nothing
    await asyncio.sleep(0.05)
    queue_key = router.keys.queue(*CHAT)
    # The real threshold is an hour; 10 ms stands in for it here.
    assert await router.calls.run("PRUNE", [queue_key], [10]) == 1
    r = client()
    try:
        names = {c["name"] for c in await r.xinfo_consumers(queue_key, GROUP)}
    finally:
        await r.aclose()
    assert names == {b"holder"}
    assert await held.renew() is Lease.HELD


@pytest.mark.parametrize(
    "event",
    [
        Data('data: {"a": "\\u00e9\\n"}'),
        Result('{"object":"list"}'),
        Done(),
        Failed(429, ErrorBody(message="slow down", type="rate_limit_error", code=429)),
        Assigned("w-1", 3),
        Assigned("router-1", 2, "gpu-1-ab12cd"),
        Requeued("backend restarting"),
        Loading("qwen-7b"),
    ],
)
def test_events_round_trip_through_json(event: JobEvent) -> None:
    raw = events.encode(event)
    assert events.decode(raw) == event
    assert events.decode(raw.decode()) == event


def test_assigned_names_its_worker_only_when_it_has_one() -> None:
    """The ``worker`` field is optional both ways: the queue's own event and an older
    consumer's have none (and are written as before); readers that predate it ignore it."""
    assert events.encode(Assigned("c", 1)) == b'{"t":"assigned","consumer":"c","attempt":1}'
    assert events.decode(b'{"t":"assigned","consumer":"c","attempt":1}') == Assigned("c", 1)
    named = orjson.loads(events.encode(Assigned("c", 1, "gpu-1")))
    assert named == {"t": "assigned", "consumer": "c", "attempt": 1, "worker": "gpu-1"}


@pytest.mark.parametrize("raw", [b"", b"[]", b'{"t":"nope"}', b'{"t":"failed","status":1}'])
def test_foreign_entries_are_refused(raw: bytes) -> None:
    with pytest.raises(events.BadEvent):
        events.decode(raw)


async def test_a_foreign_entry_fails_only_its_own_reader(queue: Factory, prefix: str) -> None:
    router, worker = queue("r1"), queue("w1")
    bad, good = job(), job()
    for j in (bad, good):
        await router.enqueue(j)
    claims = {c.job.id: c for c in await worker.claim([CHAT], 2, 100)}
    r = client()
    try:
        await r.xadd(router.keys.out(bad.id), {"e": b"not json"})
    finally:
        await r.aclose()
    async with running_tail(prefix=prefix) as tail:
        with pytest.raises(events.BadEvent):
            await read_tail(tail, bad.id)
        await worker.publish(claims[good.id], Done())
        assert outputs(await read_tail(tail, good.id)) == [Done()]


async def test_a_dead_holder_mid_answer_goes_on_from_its_trail(queue: Factory) -> None:
    """The holder published output with its trail and died: the sweep puts the job back with
    the ids the client has, and the next consumer is told to go on from there."""
    router, dead, alive = queue("r1", resume_attempts=1), queue("dead"), queue("alive")
    j = job()
    await router.enqueue(j)
    lost = await claim_one(dead)
    head = Trail((), True, "chatcmpl-3", 17)
    await dead.publish_many(
        [(lost, Data("one")), (lost, head), (lost, Data("two")), (lost, Trail((5, 6), True))]
    )
    await asyncio.sleep(LEASE_MS / 1000 + 0.05)

    swept = await router.sweep()
    assert (swept.resumed, swept.failed) == (1, 0)
    again = await claim_one(alive)
    assert again.job.id == j.id and again.resumes == 1
    assert again.resume == Continuation(tokens=(5, 6), id="chatcmpl-3", created=17)
    await alive.publish_many([(again, Data("three")), (again, Trail((7,), False))])
    await asyncio.sleep(LEASE_MS / 1000 + 0.05)
    # Its last chunk's ids were not exact, and it is out of attempts anyway: it fails.
    assert (await router.sweep()).failed == 1
    evs = await read_all(router, j.id)
    assert [e for e in evs if isinstance(e, Data)] == [Data("one"), Data("two"), Data("three")]
    assert Requeued("the worker holding this job was lost mid-answer; another goes on") in evs


def test_one_trail_per_job_per_batch_after_its_output(queue: Factory) -> None:
    q = queue("c1")
    ca, cb = (
        Claimed(QueuedJob(JobId(name), MODEL, Endpoint.CHAT, True, {}), "0-1", 1, q)
        for name in ("a", "b")
    )
    merged = coalesce(
        [
            (ca, Data("1")),
            (ca, Trail((1,), True, "id-a", 3)),
            (cb, Trail((9,), False)),
            (ca, Data("2")),
            (ca, Trail((), False)),
            (ca, Trail((2, 3), True)),
        ]
    )
    assert merged == [
        (ca, Data("1")),
        (ca, Data("2")),
        (ca, Trail((1, 2, 3), True, "id-a", 3)),
        (cb, Trail((9,), False)),
    ]
