"""Pull mode: a worker taking jobs straight from Redis (``run_worker`` with ``redis_url``).

Each test runs the real worker composition in this process (real llama-server, default
model) against the real Redis at 127.0.0.1:6379 under its own key prefix, and plays the
router's client side with ``RedisJobQueue`` (enqueue, read events, cancel).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from pydantic import SecretStr

from cluster import MODEL
from redis_server import own_redis_server
from shoal.hardware.profile import MachineProfile
from shoal.jobs import events
from shoal.protocol.ids import JobId, ModelName, new_job_id
from shoal.protocol.messages import BackendState, Endpoint, ModelInfo
from shoal.redis_queue.keys import worker_index_key, worker_key
from shoal.redis_queue.streams import RedisJobQueue
from shoal.redis_queue.support import JobStatus, QueuedJob, text
from shoal.router.dispatch.directory import parse_remote
from shoal.worker.hardware import detect_profile
from shoal.worker.link.drain import Drain
from shoal.worker.link.redis_presence import CONNECTION, PULL_HOLDER
from shoal.worker.link.redis_pull import PullState, consumer_name, plan_claim, redis_address
from shoal.worker.main import run_worker
from shoal.worker.settings import WorkerSettings
from shoal.worker.text.plan import needs_router_default, plan

REDIS_URL = "redis://127.0.0.1:6379/0"
READY_TIMEOUT_S = 60.0
ANSWER_TIMEOUT_S = 30.0

M = ModelName(MODEL)
CHAT = ModelInfo(name=M, endpoints=(Endpoint.CHAT, Endpoint.COMPLETIONS))
Started = Callable[..., AbstractAsyncContextManager[str]]


@pytest.mark.parametrize(
    ("backend", "busy", "state", "count"),
    [
        (BackendState.READY, 0, PullState.CLAIMING, 3),
        (BackendState.READY, 2, PullState.CLAIMING, 1),
        (BackendState.UNLOADED, 1, PullState.CLAIMING, 2),  # the gate loads it again
        (BackendState.READY, 3, PullState.FULL, 0),
        (BackendState.LOADING, 0, PullState.PAUSED, 0),
        (BackendState.RESTARTING, 0, PullState.PAUSED, 0),
        (BackendState.FAILED, 0, PullState.PAUSED, 0),
    ],
)
def test_claim_plan(backend: BackendState, busy: int, state: PullState, count: int) -> None:
    got = plan_claim([CHAT], backend, 3, busy)
    assert (got.state, got.count) == (state, count)
    if state is PullState.CLAIMING:
        assert got.keys == ((M, Endpoint.CHAT), (M, Endpoint.COMPLETIONS))


def test_claim_plan_limits_each_claim_to_the_context_of_a_slot() -> None:
    sized = ModelInfo(name=M, endpoints=(Endpoint.CHAT,), context_length=2048)
    assert plan_claim([sized], BackendState.READY, 1, 0).limits == {(M, Endpoint.CHAT): 2048}
    assert plan_claim([CHAT], BackendState.READY, 1, 0).limits == {}  # unsaid: any


def test_claim_plan_without_a_model_waits() -> None:
    assert plan_claim([], BackendState.READY, 3, 0).state is PullState.PAUSED


def test_logged_redis_address_has_no_password() -> None:
    assert redis_address("redis://:s3cret@db.example:6380/2") == "db.example:6380"
    assert redis_address("rediss://user:s3cret@db.example/0") == "db.example:6379"
    assert redis_address("unix:///run/redis.sock") == "unix:/run/redis.sock"


def test_redis_url_must_be_a_redis_url() -> None:
    with pytest.raises(ValueError, match="redis://"):
        WorkerSettings(redis_url=SecretStr("http://127.0.0.1:6379"))


def test_pull_mode_needs_no_router_default() -> None:
    """No router says which model to serve: ``plan`` falls back to Shoal's default model."""
    assert needs_router_default(WorkerSettings())
    assert not needs_router_default(WorkerSettings(redis_url=SecretStr(REDIS_URL)))


# ---------------------------------------------------------------- a real pull worker


@pytest.fixture(scope="session")
def machine() -> MachineProfile:
    return detect_profile()


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=10)
    yield client
    await client.aclose()


@pytest.fixture
def queue(redis_client: aioredis.Redis, redis_prefix: str) -> RedisJobQueue:
    """The client side (what a router does for a request)."""
    return RedisJobQueue(redis_client, redis_prefix, "test-client")


@pytest.fixture
def started(
    redis_prefix: str, llama_server: Path, model_path: Path, tmp_path: Path, machine: MachineProfile
) -> Started:
    """Starts a pull worker (with its llama-server) and stops it on leaving the block."""

    @contextlib.asynccontextmanager
    async def start(
        name: str = "pw",
        slots: int = 1,
        lease: float = 30.0,
        url: str = REDIS_URL,
        stop: Drain | None = None,
    ) -> AsyncIterator[str]:
        settings = WorkerSettings(
            redis_url=SecretStr(url),
            redis_prefix=redis_prefix,
            name=name,
            slots=slots,
            queue_lease=lease,
            threads=1,
            model_path=model_path,
            model_alias=MODEL,
            llama_server_path=llama_server,
            cache_dir=tmp_path / "cache",
        )
        the_plan = await asyncio.to_thread(plan, settings, None, machine)
        ready = asyncio.Event()
        main = run_worker(settings, the_plan, ready.set, machine=machine, stop=stop)
        task = asyncio.create_task(main)
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await ready.wait()
            yield name
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    return start


def ask(stream: bool, max_tokens: int = 4, **extra: Any) -> QueuedJob:
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Say hi"}],
        **extra,
    }
    if stream:
        body["stream"] = True
    return QueuedJob(new_job_id(), M, Endpoint.CHAT, stream, body)


async def answer(queue: RedisJobQueue, job_id: JobId) -> list[events.JobEvent]:
    async with asyncio.timeout(ANSWER_TIMEOUT_S):
        return [d.event async for d in queue.events(job_id)]


async def until(read: Callable[[], Awaitable[object]], expected: object) -> None:
    """Read until ``read()`` gives ``expected`` (a poll with a deadline, for Redis state)."""
    async with asyncio.timeout(ANSWER_TIMEOUT_S):
        while (got := await read()) != expected:
            await asyncio.sleep(0.05)
    assert got == expected


async def first_data(queue: RedisJobQueue, job_id: JobId) -> None:
    async with asyncio.timeout(ANSWER_TIMEOUT_S):
        async for d in queue.events(job_id):
            if isinstance(d.event, events.Data):
                return
            assert not events.is_final(d.event), d.event


async def test_jobs_are_claimed_run_and_answered_through_redis(
    started: Started, queue: RedisJobQueue
) -> None:
    async with started(name="answers"):
        streamed, whole = ask(stream=True), ask(stream=False)
        await queue.enqueue(streamed)
        await queue.enqueue(whole)
        got = await answer(queue, streamed.id)
        assigned = got[0]
        assert isinstance(assigned, events.Assigned)
        assert assigned.consumer.startswith("worker-answers-") and assigned.attempt == 1
        assert isinstance(got[-1], events.Done)
        chunks = [orjson.loads(e.data) for e in got if isinstance(e, events.Data)]
        assert chunks and all(c["model"] == MODEL for c in chunks)

        final = (await answer(queue, whole.id))[-1]
        assert isinstance(final, events.Result)
        body = orjson.loads(final.body)
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        assert await queue.status(whole.id) is JobStatus.SUCCEEDED


async def test_cancel_stops_the_job_and_frees_the_slot(
    started: Started, queue: RedisJobQueue
) -> None:
    # A long lease: the first renewal (which would see the cancellation too) comes after
    # the wait below.
    async with started(name="cancels", slots=1, lease=60.0):
        # Not streamed: it publishes nothing until the end, so only the cancellation that
        # reaches the worker (not a refused publish) can stop it. It would hold the only
        # slot for far longer than the wait below.
        long = ask(stream=False, max_tokens=3000, ignore_eos=True)
        await queue.enqueue(long)
        await until(lambda: queue.status(long.id), JobStatus.RUNNING)
        assert await queue.cancel(long.id) is JobStatus.RUNNING
        short = ask(stream=False)
        await queue.enqueue(short)
        async with asyncio.timeout(10):
            final = (await answer(queue, short.id))[-1]
        assert isinstance(final, events.Result)
        assert await queue.status(long.id) is JobStatus.CANCELLED
        await until(lambda: queue.depth(M, Endpoint.CHAT), 0)  # both acknowledged


async def test_never_runs_more_jobs_than_slots(started: Started, queue: RedisJobQueue) -> None:
    jobs = [ask(stream=True, max_tokens=60, ignore_eos=True) for _ in range(2)]
    jobs.append(ask(stream=True, max_tokens=4))
    for job in jobs:  # all waiting before the worker claims anything
        await queue.enqueue(job)
    async with started(name="slots", slots=2):
        await first_data(queue, jobs[0].id)
        counts = await queue.counts(M, Endpoint.CHAT)
        assert (counts.running, counts.waiting) == (2, 1)
        assert await queue.status(jobs[2].id) is JobStatus.WAITING
        for job in jobs:
            assert isinstance((await answer(queue, job.id))[-1], events.Done)


async def test_listed_in_the_worker_list_while_running(
    started: Started, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    index = worker_index_key(redis_prefix)
    async with started(name="listed"):
        [worker_id] = [text(m) for m in await redis_client.smembers(index)]
        assert worker_id.startswith("listed-")
        key = worker_key(redis_prefix, worker_id)

        async def state() -> str:
            raw = await redis_client.hget(key, "summary")
            return str(orjson.loads(raw)["state"]) if raw else "missing"

        await until(state, "ready")  # written at once when the backend's state changes
        router, raw = await redis_client.hmget(key, ["router", "summary"])
        assert router == PULL_HOLDER.encode() and raw is not None
        assert 0 < await redis_client.pttl(key) <= 15_000
        # What every router reads of it (a router never takes "pull" for its own name).
        remote = parse_remote(worker_id, text(router), raw)
        assert remote is not None
        assert remote.serves(M, Endpoint.CHAT) and remote.state is BackendState.READY
        assert remote.summary["connection"] == CONNECTION
        assert remote.summary["slots"] == 1 and remote.summary["name"] == "listed"
        assert remote.summary["hardware"]["cpu_count"] > 0
        # A job is held for it by the name it claims under (``redis_queue/claim.py``).
        assert remote.claimer == consumer_name(worker_id)
    assert not await redis_client.exists(key)
    assert not await redis_client.sismember(index, worker_id)


async def test_a_draining_pull_worker_answers_its_job_claims_no_more_and_leaves(
    started: Started, queue: RedisJobQueue, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    index = worker_index_key(redis_prefix)
    stop = Drain()
    async with started(name="drains", slots=2, stop=stop):
        [worker_id] = [text(m) for m in await redis_client.smembers(index)]
        running = ask(stream=True, max_tokens=60, ignore_eos=True)
        await queue.enqueue(running)
        await first_data(queue, running.id)
        assert stop.request() and not stop.request()  # a second SIGTERM stops at once
        later = ask(stream=False)
        await queue.enqueue(later)  # a slot is free, but it drains
        assert isinstance((await answer(queue, running.id))[-1], events.Done)
        # It stops by itself once answered: its entry goes; the later job was never claimed.
        await until(lambda: redis_client.exists(worker_key(redis_prefix, worker_id)), 0)
        assert await queue.status(later.id) is JobStatus.WAITING


async def test_rides_out_a_redis_restart(
    started: Started, redis_prefix: str, tmp_path: Path
) -> None:
    """Redis stops while a job runs: the job goes on and its answer is published once Redis
    is back; then the worker claims new jobs again."""
    with own_redis_server(tmp_path) as server:
        client = aioredis.Redis.from_url(server.url, socket_timeout=10)
        queue = RedisJobQueue(client, redis_prefix, "test-client")
        try:
            async with started(name="outage", url=server.url):
                held = ask(stream=False, max_tokens=200, ignore_eos=True)
                await queue.enqueue(held)
                await until(lambda: queue.status(held.id), JobStatus.RUNNING)
                await asyncio.to_thread(server.stop)
                await asyncio.sleep(1.0)  # the outage: Redis stays down this long
                await asyncio.to_thread(server.start)
                assert isinstance((await answer(queue, held.id))[-1], events.Result)
                after = ask(stream=True)
                await queue.enqueue(after)
                assert isinstance((await answer(queue, after.id))[-1], events.Done)
        finally:
            await client.aclose()
