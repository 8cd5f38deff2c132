"""The Redis dispatcher: two of them (two routers) on the real Redis at 127.0.0.1:6379, with
real registries and worker connections but no sockets (a worker's frames are fed in, its
outbox is read). Each test uses its own key prefix and deletes its keys afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from shoal.jobs.events import Data, Done, Requeued, Result
from shoal.keys.records import Queueing
from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import (
    Continuation,
    Endpoint,
    ErrorBody,
    JobCancel,
    JobDone,
    JobFailed,
    JobResult,
    JobResume,
    JobStart,
    Message,
    ModelInfo,
    RunningJob,
    decode_router_message,
)
from shoal.router.async_jobs.records import JobStatus, JobType
from shoal.router.async_jobs.runner import dispatcher_runner
from shoal.router.async_jobs.service import JobsService, Owner
from shoal.router.async_jobs.store.memory import MemoryJobStore
from shoal.router.dispatch.fair_queue import Tenant
from shoal.router.dispatch.job import JobState, Submission
from shoal.router.dispatch.redis import RedisDispatcher, consumer_name
from shoal.router.dispatch.workers import ConnState, Registry, WorkerConnection
from shoal.router.errors import ModelNotFound, QueueFull, Unavailable
from shoal.router.observe.metrics import Metrics, Snapshot
from shoal.router.settings import RouterSettings
from socketless import worker_connection

M = ModelName("smol")
WAIT_S = 5.0

Factory = Callable[..., Awaitable[RedisDispatcher]]


@pytest.fixture
async def make() -> AsyncIterator[Factory]:
    """Makes running dispatchers (one Redis client each), all stopped and cleaned up after."""
    prefix = f"shoal-test-{uuid.uuid4().hex[:10]}:"
    clients: list[aioredis.Redis] = []
    tasks: list[asyncio.Task[None]] = []

    async def factory(**settings: Any) -> RedisDispatcher:
        clients.append(aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=10))
        s = RouterSettings(redis_prefix=prefix, heartbeat_interval=0.2, **settings)
        dispatcher = RedisDispatcher(
            s, Registry(), clients[-1], Metrics(Snapshot), name=consumer_name()
        )
        tasks.append(asyncio.create_task(dispatcher.run()))
        await asyncio.sleep(0)  # run() opens its task group: submit works from here on
        return dispatcher

    yield factory
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    cleaner = aioredis.Redis(host="127.0.0.1", port=6379)
    try:
        async for key in cleaner.scan_iter(match=prefix + "*", count=500):
            await cleaner.unlink(key)
    finally:
        await cleaner.aclose()
        for c in clients:
            await c.aclose()


def connect(
    dispatcher: RedisDispatcher, name: str, slots: int = 1, held: tuple[RunningJob, ...] = ()
) -> WorkerConnection:
    worker = worker_connection(name, [ModelInfo(name=M, endpoints=(Endpoint.CHAT,))], slots=slots)
    dispatcher.workers.on_registered(worker, held)
    return worker


async def frame(worker: WorkerConnection) -> Message:
    async with asyncio.timeout(WAIT_S):
        return decode_router_message(await worker.outbox.get())


async def until(check: Callable[[], object]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not check():
            await asyncio.sleep(0.02)


async def test_job_sent_to_one_router_runs_on_a_worker_of_another(make: Factory) -> None:
    a, b = await make(), await make()
    worker = connect(b, "wb")
    await until(lambda: a.remote_workers())
    [listed] = a.worker_summaries()
    assert listed["id"] == "wb" and listed["router"] == b.name
    job = a.submit(Submission(M, Endpoint.CHAT, True, {"messages": []}))
    await a.wait_assigned(job)
    start = await frame(worker)
    assert isinstance(start, JobStart) and start.job_id == job.id
    b.workers.on_chunks(worker, [(job.id, "one", None), (job.id, "two", None)])
    b.workers.on_message(worker, JobDone(job_id=job.id))
    got = [await asyncio.wait_for(job.events.get(), WAIT_S) for _ in range(3)]
    assert got == [Data("one"), Data("two"), Done()]
    assert job.state is JobState.SUCCEEDED
    assert not worker.running


async def test_a_router_hears_of_another_routers_worker_at_every_directory_sync(
    make: Factory,
) -> None:
    """What the stall rule counts as another worker heard from (``router/dispatch/stall.py``)."""
    a, b = await make(), await make()
    mine = connect(a, "wa")
    await until(lambda: b.remote_workers())
    assert a.heard_from_cluster() is None  # only its own worker: nobody else heard from
    first = b.heard_from_cluster()
    assert first is not None and time.monotonic() - first < 1.0
    await until(lambda: (b.heard_from_cluster() or 0.0) > first)  # the next sync, 0.2 s on
    mine.move(ConnState.CLOSED, "test")
    a.workers.on_lost(mine, "connection closed")
    await until(lambda: not b.remote_workers())
    last = b.heard_from_cluster()
    await asyncio.sleep(0.5)  # two syncs at the 0.2 s interval, finding nobody
    assert b.heard_from_cluster() == last


async def test_unknown_model_is_404_on_every_router(make: Factory) -> None:
    a, b = await make(), await make()
    connect(b, "wb")
    await until(lambda: a.remote_workers())
    for router in (a, b):  # each answers from the cluster's view, own workers or not
        with pytest.raises(ModelNotFound, match=f"Available: {M}[.]"):
            router.submit(Submission(ModelName("other"), Endpoint.CHAT, False, {}))


async def test_client_gone_stops_the_generation_on_the_other_router(make: Factory) -> None:
    a, b = await make(), await make()
    worker = connect(b, "wb")
    await until(lambda: a.remote_workers())
    job = a.submit(Submission(M, Endpoint.CHAT, True, {}))
    await a.wait_assigned(job)
    assert isinstance(await frame(worker), JobStart)
    a.cancel(job, "client disconnected")
    cancel = await frame(worker)
    assert isinstance(cancel, JobCancel) and cancel.job_id == job.id
    assert not worker.running


async def test_wait_limit_withdraws_the_job_from_redis(make: Factory) -> None:
    a = await make(max_wait=0.5)
    worker = connect(a, "wa")
    first = a.submit(Submission(M, Endpoint.CHAT, False, {}))
    await a.wait_assigned(first)
    assert isinstance(await frame(worker), JobStart)
    second = a.submit(Submission(M, Endpoint.CHAT, False, {}))  # the only slot is busy
    with pytest.raises(Unavailable, match="within 0.5 s"):
        await a.wait_assigned(second)
    assert second.state is JobState.FAILED
    assert str(await a.rqueue.status(second.id)) == "cancelled"


async def test_full_queue_is_a_429(make: Factory) -> None:
    a = await make(max_queue=1)
    worker = connect(a, "wa")
    first = a.submit(Submission(M, Endpoint.CHAT, False, {}))
    await a.wait_assigned(first)
    assert isinstance(await frame(worker), JobStart)
    second = a.submit(Submission(M, Endpoint.CHAT, False, {}))
    await asyncio.sleep(0.2)  # the refusal is kept until the request handler waits
    with pytest.raises(QueueFull):
        await a.wait_assigned(second)
    assert second.state is JobState.FAILED
    assert await a.rqueue.waiting() == {(M, Endpoint.CHAT): 0}  # the refused job never waited


async def test_lost_worker_job_without_output_runs_again_elsewhere(make: Factory) -> None:
    a, b = await make(), await make()
    doomed = connect(b, "doomed")
    await until(lambda: a.remote_workers())
    job = a.submit(Submission(M, Endpoint.CHAT, False, {}))
    await a.wait_assigned(job)
    assert isinstance(await frame(doomed), JobStart)
    doomed.move(ConnState.CLOSED, "test")
    b.workers.on_lost(doomed, "connection closed")
    assert isinstance(await asyncio.wait_for(job.events.get(), WAIT_S), Requeued)
    rescuer = connect(a, "rescuer")
    await a.wait_assigned(job)
    start = await frame(rescuer)
    assert isinstance(start, JobStart) and start.job_id == JobId(job.id)
    assert job.requeues == 1


async def test_retryable_failure_runs_the_job_again(make: Factory) -> None:
    a = await make()
    worker = connect(a, "wa")
    job = a.submit(Submission(M, Endpoint.CHAT, False, {}))
    await a.wait_assigned(job)
    assert isinstance(await frame(worker), JobStart)
    error = ErrorBody(message="backend restarting", type="server_error")
    a.workers.on_message(worker, JobFailed(job_id=job.id, status=503, error=error, retryable=True))
    assert isinstance(await asyncio.wait_for(job.events.get(), WAIT_S), Requeued)
    again = await frame(worker)
    assert isinstance(again, JobStart) and again.job_id == job.id
    a.workers.on_message(worker, JobResult(job_id=job.id, body='{"ok": true}'))
    assert await asyncio.wait_for(job.events.get(), WAIT_S) == Result('{"ok": true}')
    assert job.state is JobState.SUCCEEDED


async def test_worker_whose_router_died_resumes_its_stream_through_another(make: Factory) -> None:
    """Router B holds a streamed job for router A's client and dies mid-answer; its worker
    reconnects to router C, which adopts the job: the client gets every chunk exactly once."""
    a, b, c = await make(), await make(), await make()
    worker = connect(b, "wb")
    await until(lambda: a.remote_workers())
    job = a.submit(Submission(M, Endpoint.CHAT, True, {}))
    await a.wait_assigned(job)
    start = await frame(worker)
    assert isinstance(start, JobStart) and start.attempt == 1
    b.workers.on_chunks(worker, [(job.id, "one", None), (job.id, "two", None)])
    got = [await asyncio.wait_for(job.events.get(), WAIT_S) for _ in range(2)]
    assert got == [Data("one"), Data("two")]
    # B is gone for the worker (it still runs the job); it registers with C, holding it.
    again = connect(c, "wb", held=(RunningJob(job_id=job.id, attempt=1),))
    assert len(again.running) == 1  # the slot is busy from the start
    resume = await frame(again)
    assert resume == JobResume(job_id=job.id, from_chunk=2)
    b.workers.on_chunks(worker, [(job.id, "stale", None)])  # the old holder is fenced off
    assert await frame(worker) == JobCancel(job_id=job.id)
    c.workers.on_chunks(again, [(job.id, "three", None)])
    c.workers.on_message(again, JobDone(job_id=job.id))
    got = [await asyncio.wait_for(job.events.get(), WAIT_S) for _ in range(2)]
    assert got == [Data("three"), Done()]
    assert job.state is JobState.SUCCEEDED
    await until(lambda: not again.running)


async def test_a_job_run_again_elsewhere_is_cancelled_on_the_reconnecting_worker(
    make: Factory,
) -> None:
    a, b = await make(), await make()
    worker = connect(b, "wb")
    await until(lambda: a.remote_workers())
    job = a.submit(Submission(M, Endpoint.CHAT, True, {}))
    await a.wait_assigned(job)
    assert isinstance(await frame(worker), JobStart)
    stale = connect(a, "wa", held=(RunningJob(job_id=job.id, attempt=2),))
    assert await frame(stale) == JobCancel(job_id=job.id)
    unknown = connect(a, "wc", held=(RunningJob(job_id=JobId("job-gone"), attempt=1),))
    assert await frame(unknown) == JobCancel(job_id=JobId("job-gone"))
    await until(lambda: not stale.running and not unknown.running)


async def test_an_answer_whose_worker_is_lost_goes_on_on_another_routers_worker(
    make: Factory,
) -> None:
    a, b, c = await make(), await make(), await make(resume_attempts=1)
    first = connect(b, "wb")
    await until(lambda: a.remote_workers())
    job = a.submit(Submission(M, Endpoint.CHAT, True, {"messages": []}))
    await a.wait_assigned(job)
    start = await frame(first)
    assert isinstance(start, JobStart) and start.resume is None
    head = '{"id":"chatcmpl-9","created":3}'
    b.workers.on_chunks(first, [(job.id, head, ()), (job.id, "one", (11, 12))])
    got = [await asyncio.wait_for(job.events.get(), WAIT_S) for _ in range(2)]
    assert got == [Data(head), Data("one")]
    second = connect(c, "wc")  # another router's worker
    b.workers.on_lost(first, "test")
    again = await frame(second)
    assert isinstance(again, JobStart) and again.job_id == job.id
    assert again.resume == Continuation(tokens=(11, 12), id="chatcmpl-9", created=3)
    b.workers.on_chunks(first, [(job.id, "stale", (13,))])  # fenced off: no longer its job
    c.workers.on_chunks(second, [(job.id, "two", (13,))])
    c.workers.on_message(second, JobDone(job_id=job.id))
    got = [await asyncio.wait_for(job.events.get(), WAIT_S) for _ in range(3)]
    assert isinstance(got[0], Requeued) and got[1:] == [Data("two"), Done()]
    assert job.state is JobState.SUCCEEDED


async def test_an_adopted_answer_goes_on_from_its_trail_when_its_worker_dies_too(
    make: Factory,
) -> None:
    """Router B dies mid-answer; its worker reconnects to C, which adopts the job and learns
    from the trail in Redis which tokens the client has; then the worker dies too: another of
    C's workers goes on with every token."""
    a, b, c = await make(), await make(), await make()
    worker = connect(b, "wb")
    await until(lambda: a.remote_workers())
    job = a.submit(Submission(M, Endpoint.CHAT, True, {}))
    await a.wait_assigned(job)
    assert isinstance(await frame(worker), JobStart)
    head = '{"id":"chatcmpl-5","created":8}'
    b.workers.on_chunks(worker, [(job.id, head, ()), (job.id, "one", (1, 2))])
    got = [await asyncio.wait_for(job.events.get(), WAIT_S) for _ in range(2)]
    assert got == [Data(head), Data("one")]
    again = connect(c, "wb", held=(RunningJob(job_id=job.id, attempt=1),))
    assert await frame(again) == JobResume(job_id=job.id, from_chunk=2)
    c.workers.on_chunks(again, [(job.id, "two", (3,))])
    assert await asyncio.wait_for(job.events.get(), WAIT_S) == Data("two")
    spare = connect(c, "spare")
    c.workers.on_lost(again, "test")
    start = await frame(spare)
    assert isinstance(start, JobStart) and start.job_id == job.id
    assert start.resume == Continuation(tokens=(1, 2, 3), id="chatcmpl-5", created=8)


async def test_fair_order_places_and_key_caps_are_shared_through_redis(make: Factory) -> None:
    """Two routers, one worker slot busy: a key flooding router A waits behind a light key's
    request on router B, every router sees the places and counts, and a capped key is
    refused on B for what waits on A."""
    a, b = await make(), await make()
    worker = connect(b, "wb")
    await until(lambda: a.remote_workers())
    heavy, light, capped = Tenant("heavy"), Tenant("light"), Tenant("capped", max_queued=1)
    busy = b.submit(Submission(M, Endpoint.CHAT, False, {}, heavy))
    await b.wait_assigned(busy)
    assert isinstance(await frame(worker), JobStart)
    flood = [a.submit(Submission(M, Endpoint.CHAT, True, {}, heavy)) for _ in range(3)]
    positions = a.queue_positions(flood[-1])
    assert positions is not None
    assert await anext(positions) == 2  # behind the two heavy jobs queued before it
    mine = b.submit(Submission(M, Endpoint.CHAT, True, {}, light))
    light_places = b.queue_positions(mine)
    assert light_places is not None
    assert await anext(light_places) == 0  # its tag is V: ahead of the whole flood
    await until(lambda: b.waiting_by_key() == {"heavy": 3, "light": 1})
    first = a.submit(Submission(M, Endpoint.CHAT, False, {}, capped))
    second = b.submit(Submission(M, Endpoint.CHAT, False, {}, capped))
    with pytest.raises(QueueFull) as refused:
        await b.wait_assigned(second)
    assert refused.value.code == "key_queue_full"
    for router, job in [(a, first), (b, mine), *((a, j) for j in flood)]:
        router.cancel(job, "test over")
    await until(lambda: a.waiting_by_key() == {})  # nothing left counted


async def test_async_jobs_of_a_capped_key_are_counted_over_every_router(make: Factory) -> None:
    """Async jobs queue in Redis with their key's cap: a job accepted by router B is refused
    (failed, ``key_queue_full``) for the key's job that waits on router A."""
    a, b = await make(), await make()
    worker = connect(b, "wb")
    await until(lambda: a.remote_workers())
    owner = Owner("capped", Queueing(weight=2.0, max_queued=1))
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    store = MemoryJobStore()  # one store for both routers' records (Redis's is tested apart)
    on_a = JobsService(store, dispatcher_runner(a))
    on_b = JobsService(store, dispatcher_runner(b))
    async with on_a.running(), on_b.running():
        running = await on_a.submit(JobType.CHAT_COMPLETION, M, chat, owner)
        assert isinstance(await frame(worker), JobStart)
        waiting = await on_a.submit(JobType.CHAT_COMPLETION, M, chat, owner)
        await until(lambda: b.waiting_by_key() == {"capped": 1})
        refused = await on_b.submit(JobType.CHAT_COMPLETION, M, chat, owner)
        async with asyncio.timeout(WAIT_S):
            await on_b.wait_idle()  # refused at once, not waiting
        await on_a.cancel(running.id, "capped")
        await on_a.cancel(waiting.id, "capped")
        await on_a.wait_idle()
    failed = await store.get(refused.id)
    assert failed is not None and failed.status is JobStatus.FAILED and failed.error is not None
    assert failed.error["code"] == "key_queue_full"
    await until(lambda: a.waiting_by_key() == {})
