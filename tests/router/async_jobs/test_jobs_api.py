"""The async jobs API: records and their two stores (memory, and real Redis on loopback), the
service that runs jobs in its task group, the /v1/jobs routes on a tiny FastAPI app, and the
dispatcher runner against the real dispatcher with a real (socket-less) worker connection.

``FakeRunner`` below is a FAKE of the dispatcher-backed runner (``dispatcher_runner``): it
imitates a job being queued, a worker taking it and the answer coming back, one step at a
time as each test says, so the lifecycle can be observed at every status.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI
from starlette.datastructures import Headers

from shoal.keys.records import Queueing
from shoal.lifecycle import IllegalTransition
from shoal.protocol.ids import ModelName
from shoal.protocol.messages import (
    Endpoint,
    ErrorBody,
    JobCancel,
    JobFailed,
    JobResult,
    JobStart,
    ModelInfo,
    decode_router_message,
)
from shoal.router import errors
from shoal.router.admission.requests import RequestLimits
from shoal.router.async_jobs.records import (
    AsyncJobId,
    JobRecord,
    JobStatus,
    JobType,
    new_async_job_id,
    parse_async_job_id,
)
from shoal.router.async_jobs.runner import dispatcher_runner
from shoal.router.async_jobs.service import (
    JobsService,
    Owner,
    RunFailed,
    Runner,
    RunOutcome,
    RunRequest,
    RunSucceeded,
)
from shoal.router.async_jobs.store.interface import JobStore
from shoal.router.async_jobs.store.memory import MemoryJobStore
from shoal.router.async_jobs.store.redis import RedisJobStore, job_key
from shoal.router.dispatch.fair_queue import Priority, Tenant
from shoal.router.dispatch.interface import Dispatcher
from shoal.router.dispatch.workers import WorkerConnection
from shoal.router.errors import BadRequest, ModelNotFound, Unauthorized
from shoal.router.routes import jobs as jobs_routes
from socketless import memory_dispatcher, worker_connection

REDIS_URL = "redis://127.0.0.1:6379/0"
KEYS = {"key-a": "a", "key-b": "b"}
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}
CHAT = [{"role": "user", "content": "hi"}]
LIMITS = RequestLimits(max_body_bytes=4096, max_messages=4, max_tokens=64)
ANSWER = {"object": "chat.completion", "choices": [{"message": {"content": "hello"}}]}
WAIT_S = 5.0


# ---------------------------------------------------------------- the FAKE runner


@dataclass
class FakeRun:
    request: RunRequest
    start: asyncio.Event = field(default_factory=asyncio.Event)
    running: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: asyncio.Future[RunOutcome] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    cancelled: bool = False


class FakeRunner:
    """FAKE of ``dispatcher_runner``: waits for ``start`` (a worker takes the job), says so,
    then returns whatever the test puts in ``outcome`` (or raises what it sets there)."""

    def __init__(self) -> None:
        self.arrived: asyncio.Queue[FakeRun] = asyncio.Queue()

    async def __call__(self, request: RunRequest) -> RunOutcome:
        run = FakeRun(request)
        self.arrived.put_nowait(run)
        try:
            await run.start.wait()
            await request.started()
            run.running.set()
            return await run.outcome
        except asyncio.CancelledError:
            run.cancelled = True
            raise
        finally:
            run.ended.set()

    async def next(self) -> FakeRun:
        async with asyncio.timeout(WAIT_S):
            return await self.arrived.get()


def check_key(headers: Headers) -> Owner:
    """The composition root's key check, for two keys: the key's owner, or 401."""
    token = headers.get("authorization", "").removeprefix("Bearer ")
    if token not in KEYS:
        raise Unauthorized("Incorrect API key provided.")
    return Owner(KEYS[token])


async def check_key_async(headers: Headers) -> Owner:
    """The same check as a coroutine (the router's key check may ask its key database)."""
    return check_key(headers)


# ---------------------------------------------------------------- fixtures


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def prefix(redis_client: aioredis.Redis) -> AsyncIterator[str]:
    """A Redis key prefix of this test alone; its keys are deleted afterwards."""
    name = f"test-jobs-{uuid.uuid4().hex}:"
    yield name
    keys = [key async for key in redis_client.scan_iter(match=name + "*")]
    if keys:
        await redis_client.delete(*keys)


StoreFactory = Callable[..., JobStore]


@pytest.fixture(params=["memory", "redis"])
def make_store(
    request: pytest.FixtureRequest, redis_client: aioredis.Redis, prefix: str
) -> StoreFactory:
    def make(ttl_s: float = 3600.0, **kwargs: Any) -> JobStore:
        if request.param == "memory":
            return MemoryJobStore(ttl_s, **kwargs)
        return RedisJobStore(redis_client, prefix, ttl_s, **kwargs)

    return make


def every_model_served(model: ModelName, endpoint: Endpoint) -> None:
    """The jobs routes' model check for these tests: the fake runner takes any model."""


@asynccontextmanager
async def serving(
    store: JobStore,
    runner: Runner,
    keys: jobs_routes.KeyCheckFn = check_key,
    served: jobs_routes.ServedCheck = every_model_served,
    **kwargs: Any,
) -> AsyncIterator[tuple[JobsService, httpx.AsyncClient]]:
    """The jobs service running, and a client for a tiny app with the jobs routes. A 202
    answers at once (``first_news_wait_s=0``): the fake runner reports only when told to."""
    kwargs.setdefault("first_news_wait_s", 0.0)
    service = JobsService(store, runner, **kwargs)
    app = FastAPI()
    errors.install(app)
    jobs_routes.install(
        app, service, limits=LIMITS, default_model="default-model", check_served=served
    )
    app.state.check_key = keys
    transport = httpx.ASGITransport(app=app)
    async with (
        service.running(),
        httpx.AsyncClient(transport=transport, base_url="http://router") as client,
    ):
        yield service, client


async def post_chat(client: httpx.AsyncClient, **extra: Any) -> dict[str, Any]:
    reply = await client.post(
        "/v1/jobs", json={"type": "chat_completion", "messages": CHAT, **extra}, headers=A
    )
    assert reply.status_code == 202, reply.text
    assert reply.headers["location"] == f"/v1/jobs/{reply.json()['id']}"
    job: dict[str, Any] = reply.json()
    return job


async def status_of(client: httpx.AsyncClient, job_id: str, headers: dict[str, str] = A) -> str:
    reply = await client.get(f"/v1/jobs/{job_id}", headers=headers)
    assert reply.status_code == 200, reply.text
    status: str = reply.json()["status"]
    return status


# ---------------------------------------------------------------- lifecycle through the API


async def test_a_job_goes_queued_running_succeeded(make_store: StoreFactory) -> None:
    runner = FakeRunner()
    async with serving(make_store(), runner) as (service, client):
        job = await post_chat(client, temperature=0)
        assert job["object"] == "job" and job["status"] == "queued"
        assert job["type"] == "chat_completion" and job["model"] == "default-model"
        run = await runner.next()
        assert run.request.endpoint is Endpoint.CHAT and run.request.key_id == "a"
        assert run.request.body == {"messages": CHAT, "temperature": 0, "max_tokens": 64}
        assert await status_of(client, job["id"]) == "queued"
        run.start.set()
        await run.running.wait()
        assert await status_of(client, job["id"]) == "running"
        run.outcome.set_result(RunSucceeded(ANSWER))
        await service.wait_idle()
        done = (await client.get(f"/v1/jobs/{job['id']}", headers=A)).json()
    assert done["status"] == "succeeded" and done["result"] == ANSWER and done["error"] is None
    assert done["created_at"] <= done["finished_at"] <= done["expires_at"] - 3599


async def test_a_failed_run_is_recorded_with_its_error(make_store: StoreFactory) -> None:
    runner = FakeRunner()
    error = {"message": "context too long", "type": "invalid_request_error", "param": None}
    async with serving(make_store(), runner) as (service, client):
        job = await post_chat(client)
        run = await runner.next()
        run.start.set()
        run.outcome.set_result(RunFailed(400, {**error, "code": "context_length"}))
        await service.wait_idle()
        done = (await client.get(f"/v1/jobs/{job['id']}", headers=A)).json()
    assert done["status"] == "failed" and done["result"] is None
    assert done["error"] == {**error, "code": "context_length"}


async def test_runner_errors_fail_the_job_and_not_the_service(make_store: StoreFactory) -> None:
    runner = FakeRunner()
    async with serving(make_store(), runner) as (service, client):
        refused, crashed, fine = [await post_chat(client) for _ in range(3)]
        runs = [await runner.next() for _ in range(3)]
        runs[0].outcome.set_exception(ModelNotFound("The model 'x' is not served."))
        runs[1].outcome.set_exception(ValueError("a bug"))
        runs[2].outcome.set_result(RunSucceeded(ANSWER))
        for run in runs:
            run.start.set()
        await service.wait_idle()
        got = [
            (await client.get(f"/v1/jobs/{j['id']}", headers=A)).json()
            for j in (refused, crashed, fine)
        ]
    assert got[0]["status"] == "failed" and got[0]["error"]["code"] == "model_not_found"
    assert got[1]["status"] == "failed" and "Internal error" in got[1]["error"]["message"]
    assert got[2]["status"] == "succeeded"


async def test_delete_cancels_the_running_task(make_store: StoreFactory) -> None:
    runner = FakeRunner()
    async with serving(make_store(), runner) as (service, client):
        job = await post_chat(client)
        run = await runner.next()
        run.start.set()
        await run.running.wait()
        reply = await client.delete(f"/v1/jobs/{job['id']}", headers=A)
        assert reply.status_code == 200 and reply.json()["status"] == "cancelled"
        async with asyncio.timeout(WAIT_S):
            await run.ended.wait()
        assert run.cancelled
        await service.wait_idle()
        assert await status_of(client, job["id"]) == "cancelled"
        again = await client.delete(f"/v1/jobs/{job['id']}", headers=A)
    assert again.status_code == 409 and again.json()["error"]["code"] == "job_finished"


async def test_delete_while_queued_and_after_success(make_store: StoreFactory) -> None:
    runner = FakeRunner()
    async with serving(make_store(), runner) as (service, client):
        queued = await post_chat(client)
        waiting = await runner.next()
        cancelled = await client.delete(f"/v1/jobs/{queued['id']}", headers=A)
        assert cancelled.json()["status"] == "cancelled" and cancelled.json()["finished_at"]
        async with asyncio.timeout(WAIT_S):
            await waiting.ended.wait()
        assert waiting.cancelled and not waiting.running.is_set()
        finished = await post_chat(client)
        run = await runner.next()
        run.start.set()
        run.outcome.set_result(RunSucceeded(ANSWER))
        await service.wait_idle()
        late = await client.delete(f"/v1/jobs/{finished['id']}", headers=A)
        assert late.status_code == 409
        assert await status_of(client, finished["id"]) == "succeeded"


@pytest.mark.parametrize("keys", [check_key, check_key_async])
async def test_another_key_cannot_see_or_cancel_a_job(
    make_store: StoreFactory, keys: jobs_routes.KeyCheckFn
) -> None:
    runner = FakeRunner()
    async with serving(make_store(), runner, keys) as (_, client):
        job = await post_chat(client)
        await runner.next()
        for method in ("GET", "DELETE"):
            other = await client.request(method, f"/v1/jobs/{job['id']}", headers=B)
            assert other.status_code == 404, method
            assert other.json()["error"]["code"] == "job_not_found"
            nobody = await client.request(method, f"/v1/jobs/{job['id']}")
            assert nobody.status_code == 401
        assert await status_of(client, job["id"]) == "queued"


async def test_unknown_and_malformed_ids_are_404(make_store: StoreFactory) -> None:
    async with serving(make_store(), FakeRunner()) as (_, client):
        for job_id in (new_async_job_id(), "nope", "ajob_" + "g" * 32):
            reply = await client.get(f"/v1/jobs/{job_id}", headers=A)
            assert reply.status_code == 404 and "POST /v1/jobs" in reply.json()["error"]["message"]


async def test_more_than_max_active_jobs_get_429(make_store: StoreFactory) -> None:
    async with serving(make_store(), FakeRunner(), max_active=1) as (_, client):
        await post_chat(client)
        reply = await client.post("/v1/jobs", json={"type": "embedding", "input": "x"}, headers=A)
    assert reply.status_code == 429 and reply.json()["error"]["code"] == "too_many_jobs"
    assert reply.headers["retry-after"]


# ---------------------------------------------------------------- request checks


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": CHAT}, "type", "chat_completion, completion, embedding"),
        ({"type": "image", "prompt": "cat"}, "type", "Valid types: chat_completion"),
        ({"type": ["chat"], "messages": CHAT}, "type", "Unknown job type"),
        ({"type": "chat_completion", "messages": CHAT, "stream": True}, "stream", "never"),
        ({"type": "embedding", "input": "x", "stream": True}, "stream", "never streamed"),
        ({"type": "chat_completion"}, "messages", "required"),
        ({"type": "completion", "prompt": "x", "max_tokens": 65}, "max_tokens", "65"),
        ({"type": "chat_completion", "messages": CHAT, "stream": "yes"}, "stream", "true or"),
    ],
)
def test_job_requests_are_checked_like_the_endpoint(
    body: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(BadRequest) as info:
        jobs_routes.parse_job_request(body, "m", LIMITS)
    assert info.value.param == param and words in info.value.message


def test_a_job_request_becomes_the_endpoint_body() -> None:
    job = jobs_routes.parse_job_request(
        {"type": "embedding", "model": "e5", "input": ["a", "b"]}, "m", LIMITS
    )
    assert job.type is JobType.EMBEDDING and job.type.endpoint is Endpoint.EMBEDDINGS
    assert job.request.model == "e5" and job.request.body == {"model": "e5", "input": ["a", "b"]}


async def test_bad_requests_are_refused_before_queueing(make_store: StoreFactory) -> None:
    runner = FakeRunner()
    async with serving(make_store(), runner) as (service, client):
        not_json = await client.post("/v1/jobs", content=b"{", headers=A)
        unknown = await client.post("/v1/jobs", json={"type": "video"}, headers=A)
        no_key = await client.post("/v1/jobs", json={"type": "embedding", "input": "x"})
        assert service.active == 0 and runner.arrived.empty()
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "type"
    assert no_key.status_code == 401


# ---------------------------------------------------------------- stores


def record(owner: str | None = "a") -> JobRecord:
    return JobRecord(
        id=new_async_job_id(), type=JobType.COMPLETION, model="m", owner=owner, created_at=1.0
    )


async def test_store_keeps_the_queue_position_only_while_queued(make_store: StoreFactory) -> None:
    store = make_store()
    rec = record()
    await store.create(rec)
    await store.set_queue_position(rec.id, 3)
    queued = await store.get(rec.id)
    assert queued is not None and queued.to_api()["queue_position"] == 3
    await store.set_running(rec.id)
    await store.set_queue_position(rec.id, 1)  # too late: ignored
    running = await store.get(rec.id)
    assert running is not None and running.to_api()["queue_position"] is None


async def test_store_transitions_have_one_winner(make_store: StoreFactory) -> None:
    store = make_store()
    rec = record()
    await store.create(rec)
    running = await store.set_running(rec.id)
    assert running is not None and running.status is JobStatus.RUNNING
    assert await store.set_running(rec.id) is None  # not queued any more
    cancel = await store.cancel(rec.id)
    assert cancel.cancelled and cancel.record is not None
    assert cancel.record.status is JobStatus.CANCELLED and cancel.record.finished_at is not None
    assert await store.finish(rec.id, result=ANSWER) is None  # the cancel won
    again = await store.cancel(rec.id)
    assert not again.cancelled and again.record == cancel.record
    missing = await store.cancel(new_async_job_id())
    assert missing.record is None and not missing.cancelled
    assert await store.get(rec.id) == cancel.record


async def test_store_round_trips_every_field(make_store: StoreFactory) -> None:
    store = make_store(ttl_s=60.0)
    rec = record(owner=None)
    await store.create(rec)
    assert await store.get(rec.id) == rec
    error = {"message": "m", "type": "t", "param": None, "code": 7}
    failed = await store.finish(rec.id, error=error)  # failing straight from queued is allowed
    assert failed is not None and failed.error == error and failed.result is None
    assert failed.expires_at is not None and failed.finished_at is not None
    assert failed.expires_at - failed.finished_at == pytest.approx(60.0)
    assert await store.get(rec.id) == failed


async def test_finish_needs_a_result_or_an_error(make_store: StoreFactory) -> None:
    store = make_store()
    rec = record()
    await store.create(rec)
    with pytest.raises(IllegalTransition):
        await store.finish(rec.id, result=ANSWER)  # a queued job has not run
    assert await store.get(rec.id) == rec
    await store.set_running(rec.id)
    with pytest.raises(ValueError):
        await store.finish(rec.id)
    with pytest.raises(ValueError):
        await store.finish(rec.id, result=ANSWER, error={"message": "x"})


def test_illegal_transitions_raise() -> None:
    rec = record()
    with pytest.raises(IllegalTransition):
        rec.moved(JobStatus.SUCCEEDED)  # a queued job has not run
    done = rec.moved(JobStatus.RUNNING).ended(2.0, 10.0, result=ANSWER)
    assert done.status is JobStatus.SUCCEEDED and done.expires_at == 12.0
    with pytest.raises(IllegalTransition):
        done.moved(JobStatus.CANCELLED)


def test_ids_are_random_and_parsed_strictly() -> None:
    ids = {new_async_job_id() for _ in range(100)}
    assert len(ids) == 100 and all(parse_async_job_id(i) == i for i in ids)
    for bad in ("", "ajob_", "job_0123", "ajob_" + "0" * 31, "ajob_" + "0" * 32 + "\n"):
        assert parse_async_job_id(bad) is None


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_memory_results_expire_after_the_ttl() -> None:
    clock = Clock()
    runner = FakeRunner()
    async with serving(MemoryJobStore(60.0, clock=clock), runner, clock=clock) as (s, client):
        job = await post_chat(client)
        run = await runner.next()
        run.start.set()
        run.outcome.set_result(RunSucceeded(ANSWER))
        await s.wait_idle()
        clock.now += 59.9
        assert await status_of(client, job["id"]) == "succeeded"
        clock.now += 0.2
        gone = await client.get(f"/v1/jobs/{job['id']}", headers=A)
    assert gone.status_code == 404 and "60 s ago" in gone.json()["error"]["message"]


async def test_memory_store_timer_drops_expired_records_unasked() -> None:
    store = MemoryJobStore(0.05)
    recs = [record() for _ in range(3)]
    async with asyncio.TaskGroup() as tg:
        sweeper = tg.create_task(store.run(lambda _: None))
        for rec in recs:
            await store.create(rec)
        await store.set_running(recs[0].id)
        await store.finish(recs[0].id, result=ANSWER)
        await store.cancel(recs[1].id)
        await asyncio.sleep(0.2)  # real time must pass for a real TTL
        assert len(store) == 1  # dropped by the timer: nothing read the store meanwhile
        sweeper.cancel()
    assert await store.get(recs[2].id) == recs[2]  # live records never expire


async def test_memory_store_keeps_at_most_max_finished_results() -> None:
    clock = Clock()
    store = MemoryJobStore(60.0, max_finished=2, clock=clock)
    recs = [record() for _ in range(4)]
    for rec in recs:
        await store.create(rec)
    for rec in recs[:3]:
        clock.now += 1
        await store.cancel(rec.id)
    assert await store.get(recs[0].id) is None  # the oldest finished one went early
    assert all([await store.get(rec.id) is not None for rec in recs[1:]])
    assert len(store) == 3  # two finished, one live


async def test_redis_records_expire(redis_client: aioredis.Redis, prefix: str) -> None:
    store = RedisJobStore(redis_client, prefix, 0.1, live_ttl_s=7200.0)
    rec = record()
    await store.create(rec)
    assert 7100_000 < await redis_client.pttl(job_key(prefix, rec.id)) <= 7200_000
    await store.set_running(rec.id)
    await store.finish(rec.id, result=ANSWER)
    assert 0 < await redis_client.pttl(job_key(prefix, rec.id)) <= 100
    await asyncio.sleep(0.2)  # real time must pass for Redis to expire the key
    assert await store.get(rec.id) is None


async def test_redis_cancel_on_one_router_stops_the_run_on_another(
    redis_client: aioredis.Redis, prefix: str
) -> None:
    runner = FakeRunner()
    here = RedisJobStore(redis_client, prefix)
    there = JobsService(RedisJobStore(redis_client, prefix), FakeRunner())
    async with serving(here, runner) as (_, client), there.running():
        async with asyncio.timeout(WAIT_S):
            await here.subscribed.wait()
        job = await post_chat(client)
        run = await runner.next()
        run.start.set()
        await run.running.wait()
        cancelled = await there.cancel(job["id"], "a")
        assert cancelled.status is JobStatus.CANCELLED
        async with asyncio.timeout(WAIT_S):
            await run.ended.wait()
        assert run.cancelled
        assert await status_of(client, job["id"]) == "cancelled"


async def test_the_cancel_listener_stops_whenever_it_is_cancelled(
    redis_client: aioredis.Redis, prefix: str
) -> None:
    """redis-py can swallow a cancel that lands while it subscribes; the store must not."""
    store = RedisJobStore(redis_client, prefix)
    for steps in range(40):  # cancel at each point of connecting, subscribing and reading
        listener = asyncio.create_task(store.run(lambda _: None))
        for _ in range(steps):
            await asyncio.sleep(0)
        listener.cancel()
        done, _ = await asyncio.wait([listener], timeout=WAIT_S)
        assert done and listener.cancelled(), f"still listening after a cancel at step {steps}"


async def test_stopping_the_service_fails_the_jobs_it_was_running(
    redis_client: aioredis.Redis, prefix: str
) -> None:
    runner = FakeRunner()
    store = RedisJobStore(redis_client, prefix)
    async with serving(store, runner) as (_, client):
        job = await post_chat(client)
        run = await runner.next()
        run.start.set()
        await run.running.wait()
    assert run.cancelled
    after = await store.get(AsyncJobId(job["id"]))
    assert after is not None and after.status is JobStatus.FAILED
    assert after.error is not None and after.error["code"] == "router_stopped"


async def test_submit_needs_the_service_running() -> None:
    service = JobsService(MemoryJobStore(), FakeRunner())
    with pytest.raises(RuntimeError, match="lifespan"):
        await service.submit(JobType.EMBEDDING, "m", {"input": "x"}, Owner(None))


# ---------------------------------------------------------------- the dispatcher runner

M = ModelName("smol")


def connect(dispatcher: Dispatcher) -> WorkerConnection:
    worker = worker_connection(
        "w1", [ModelInfo(name=M, endpoints=(Endpoint.CHAT, Endpoint.EMBEDDINGS))]
    )
    dispatcher.workers.on_registered(worker)
    return worker


async def next_frame(worker: WorkerConnection) -> object:
    async with asyncio.timeout(WAIT_S):
        return decode_router_message(await worker.outbox.get())


@pytest.fixture
def dispatcher() -> Iterator[Dispatcher]:
    yield memory_dispatcher()


async def test_dispatcher_runner_returns_the_workers_answer(dispatcher: Dispatcher) -> None:
    worker = connect(dispatcher)
    store = MemoryJobStore()
    service = JobsService(store, dispatcher_runner(dispatcher))
    async with service.running():
        rec = await service.submit(JobType.CHAT_COMPLETION, M, {"messages": CHAT}, Owner("a"))
        start = await next_frame(worker)
        assert isinstance(start, JobStart) and not start.stream
        assert start.endpoint is Endpoint.CHAT and start.body == {"messages": CHAT}
        assert worker.running[start.job_id].key_id == "a"
        running = await store.get(rec.id)
        assert running is not None and running.status is JobStatus.RUNNING
        dispatcher.workers.on_message(worker, JobResult(job_id=start.job_id, body='{"ok": 1}'))
        await service.wait_idle()
    done = await store.get(rec.id)
    assert done is not None and done.status is JobStatus.SUCCEEDED and done.result == {"ok": 1}
    assert not worker.running


async def test_dispatcher_runner_reports_worker_errors(dispatcher: Dispatcher) -> None:
    worker = connect(dispatcher)
    store = MemoryJobStore()
    service = JobsService(store, dispatcher_runner(dispatcher))
    async with service.running():
        rec = await service.submit(JobType.EMBEDDING, M, {"input": "x"}, Owner(None))
        start = await next_frame(worker)
        assert isinstance(start, JobStart)
        failure = ErrorBody(message="too long", type="invalid_request_error", code=None)
        dispatcher.workers.on_message(
            worker, JobFailed(job_id=start.job_id, status=400, error=failure)
        )
        unknown = await service.submit(
            JobType.EMBEDDING, ModelName("nope"), {"input": "x"}, Owner(None)
        )
        await service.wait_idle()
    failed, refused = await store.get(rec.id), await store.get(unknown.id)
    assert failed is not None and failed.error is not None
    assert failed.status is JobStatus.FAILED and failed.error["message"] == "too long"
    assert refused is not None and refused.error is not None
    assert refused.error["code"] == "model_not_found"


async def test_cancelling_a_dispatched_job_stops_the_worker(dispatcher: Dispatcher) -> None:
    worker = connect(dispatcher)
    service = JobsService(MemoryJobStore(), dispatcher_runner(dispatcher))
    async with service.running():
        rec = await service.submit(JobType.CHAT_COMPLETION, M, {"messages": CHAT}, Owner(None))
        start = await next_frame(worker)
        assert isinstance(start, JobStart)
        await service.cancel(rec.id, None)
        cancel = await next_frame(worker)
        await service.wait_idle()
    assert isinstance(cancel, JobCancel) and cancel.job_id == start.job_id
    assert not worker.running


async def test_a_queued_async_job_shows_its_place_until_a_worker_takes_it(
    dispatcher: Dispatcher,
) -> None:
    worker = connect(dispatcher)  # one slot
    store = MemoryJobStore()
    service = JobsService(store, dispatcher_runner(dispatcher))
    async with service.running():
        first = await service.submit(JobType.CHAT_COMPLETION, M, {"messages": CHAT}, Owner("a"))
        second = await service.submit(JobType.CHAT_COMPLETION, M, {"messages": CHAT}, Owner("a"))
        third = await service.submit(JobType.CHAT_COMPLETION, M, {"messages": CHAT}, Owner("a"))
        start = await next_frame(worker)
        assert isinstance(start, JobStart)

        async def places() -> list[int | None]:
            records = [await store.get(r.id) for r in (first, second, third)]
            return [r.to_api()["queue_position"] for r in records if r is not None]

        async with asyncio.timeout(WAIT_S):
            while await places() != [None, 0, 1]:  # the first runs; the others wait in order
                await asyncio.sleep(0.01)
        dispatcher.workers.on_message(worker, JobResult(job_id=start.job_id, body='{"ok": 1}'))
        async with asyncio.timeout(WAIT_S):
            while await places() != [None, None, 0]:  # the second runs; the third moved up
                await asyncio.sleep(0.01)
        for _ in range(2):
            start = await next_frame(worker)
            assert isinstance(start, JobStart)
            dispatcher.workers.on_message(worker, JobResult(job_id=start.job_id, body="{}"))
        await service.wait_idle()


async def test_the_record_submit_returns_says_where_the_job_stands(
    dispatcher: Dispatcher,
) -> None:
    """What the 202 shows: running when a worker took the job at once, else its place (it
    was queued with no place: the runner reports it a moment later)."""
    worker = connect(dispatcher)  # one slot
    service = JobsService(MemoryJobStore(), dispatcher_runner(dispatcher))
    chat = {"messages": CHAT}
    async with service.running():
        first = await service.submit(JobType.CHAT_COMPLETION, M, chat, Owner("a"))
        second = await service.submit(JobType.CHAT_COMPLETION, M, chat, Owner("a"))
        third = await service.submit(JobType.CHAT_COMPLETION, M, chat, Owner("a"))
        assert first.status is JobStatus.RUNNING
        assert [r.to_api()["queue_position"] for r in (second, third)] == [0, 1]
        for rec in (first, second, third):
            await service.cancel(rec.id, "a")
        await service.wait_idle()
    assert not worker.running


async def test_async_jobs_queue_with_their_keys_weight_and_cap_as_batch(
    dispatcher: Dispatcher,
) -> None:
    worker = connect(dispatcher)  # one slot
    store = MemoryJobStore()
    service = JobsService(store, dispatcher_runner(dispatcher))
    # an interactive key: its async jobs still queue as batch, with its weight and cap
    owner = Owner("a", Queueing(weight=3.0, priority=Priority.INTERACTIVE, max_queued=1))
    chat = {"messages": CHAT}
    async with service.running():
        running = await service.submit(JobType.CHAT_COMPLETION, M, chat, owner)
        start = await next_frame(worker)
        assert isinstance(start, JobStart)
        assert worker.running[start.job_id].tenant == Tenant("a", 3.0, Priority.BATCH, 1)
        waiting = await service.submit(JobType.CHAT_COMPLETION, M, chat, owner)
        async with asyncio.timeout(WAIT_S):
            while (await service.get(waiting.id, "a")).queue_position is None:
                await asyncio.sleep(0.01)
        refused = await service.submit(JobType.CHAT_COMPLETION, M, chat, owner)
        async with asyncio.timeout(WAIT_S):
            while (await service.get(refused.id, "a")).status is not JobStatus.FAILED:
                await asyncio.sleep(0.01)
        await service.cancel(running.id, "a")
        await service.cancel(waiting.id, "a")
        await service.wait_idle()
    failed = await store.get(refused.id)
    assert failed is not None and failed.error is not None
    assert failed.error["code"] == "key_queue_full"
