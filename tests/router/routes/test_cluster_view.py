"""Cluster-wide views: ``/health``, ``queued`` in ``/v1/models``, ``shoal_queue_depth``, and
the workers' GPU telemetry in ``/api/v1/workers`` and the ``shoal_gpu_*`` gauges.

Two routers' apps (``build_app`` with ``--redis-url``) on the real Redis at 127.0.0.1:6379,
under this test's own key prefix, with their dispatchers running; workers are real
``WorkerConnection``s without sockets (their frames are read from the outbox). Requests go
through each app with httpx. The in-process router is checked to answer as before.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from shoal.jobs import events
from shoal.protocol.ids import ModelName, WorkerId
from shoal.protocol.messages import (
    PROTOCOL_VERSION,
    BackendState,
    CacheChanged,
    Endpoint,
    Hardware,
    Heartbeat,
    ModelInfo,
    Register,
)
from shoal.protocol.prefix import prefix_chain
from shoal.protocol.telemetry import GpuSample
from shoal.redis_queue.keys import RedisKeys
from shoal.redis_queue.streams import RedisJobQueue
from shoal.router.app import build_app
from shoal.router.dispatch.interface import Dispatcher
from shoal.router.dispatch.job import Job, Submission
from shoal.router.dispatch.memory import MemoryDispatcher
from shoal.router.dispatch.redis import RedisDispatcher
from shoal.router.dispatch.workers import WorkerConnection
from shoal.router.routes.inference import FastPath
from shoal.router.settings import RouterSettings
from shoal.worker.link.redis_presence import Presence, summary
from shoal.worker.link.redis_pull import consumer_name
from socketless import worker_connection

M = ModelName("smol")
WAIT_S = 5.0
HEARTBEAT_S = 0.2


def connect(dispatcher: Dispatcher, name: str, slots: int = 1) -> WorkerConnection:
    worker = worker_connection(name, [ModelInfo(name=M, endpoints=(Endpoint.CHAT,))], slots=slots)
    dispatcher.workers.on_registered(worker)
    return worker


async def until(check: Callable[[], object], what: str) -> None:
    try:
        async with asyncio.timeout(WAIT_S):
            while not check():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


class RouterApp:
    """One router's app, its running dispatcher and an httpx client to it."""

    def __init__(self, app: FastPath) -> None:
        self.app = app
        self.ctx = app.ctx
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r")

    @property
    def dispatcher(self) -> RedisDispatcher:
        assert isinstance(self.ctx.dispatcher, RedisDispatcher)
        return self.ctx.dispatcher

    async def get(self, path: str) -> Any:
        r = await self.client.get(path)
        assert r.status_code == 200, r.text
        return r.json() if path != "/metrics" else r.text


@pytest.fixture
async def routers(tmp_path: Path, redis_prefix: str) -> AsyncIterator[Callable[..., RouterApp]]:
    """Makes routers sharing the real Redis under this test's prefix; all stopped after."""
    made: list[RouterApp] = []
    tasks: list[asyncio.Task[None]] = []

    def make(heartbeat_interval: float = HEARTBEAT_S) -> RouterApp:
        settings = RouterSettings(
            redis_url="redis://127.0.0.1:6379/0",
            redis_prefix=redis_prefix,
            heartbeat_interval=heartbeat_interval,
            database_url=f"sqlite:///{tmp_path}/keys.db",
        )
        router = RouterApp(build_app(settings))
        made.append(router)
        tasks.append(asyncio.create_task(router.dispatcher.run()))
        return router

    yield make
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for router in made:
        await router.client.aclose()
        await router.dispatcher.close()
        await router.ctx.accounting.limiter.close()
        if router.ctx.store is not None:
            router.ctx.store.close()


def sample(exposition: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise AssertionError(f"no {name} sample for {labels}")


def queue_depth(exposition: str, model: str) -> float:
    return sample(exposition, "shoal_queue_depth", model=model)


async def test_health_counts_the_workers_of_every_router(
    routers: Callable[[], RouterApp],
) -> None:
    a, b = routers(), routers()
    assert await b.get("/health") == {
        "status": "no_ready_workers",
        "version": (await a.get("/health"))["version"],
        "queue": "redis",
        "workers": 0,
        "ready_workers": 0,
        "models": [],
        "open_scopes": ["inference", "worker", "admin"],  # loopback, and no key anywhere
    }
    connect(a.dispatcher, "wa")
    loading = connect(a.dispatcher, "wl")
    loading.set_backend_state(BackendState.LOADING, "test", None)
    a.dispatcher.directory.changed()
    await until(lambda: len(b.dispatcher.remote_workers()) == 2, "B to list A's workers")
    for router in (a, b):
        health = await router.get("/health")
        assert health["workers"] == 2 and health["ready_workers"] == 1, health
        assert health["status"] == "ok" and health["models"] == [M]
    [model] = (await b.get("/v1/models"))["data"]
    assert model["id"] == M and model["workers"] == 2 and model["queued"] == 0
    # /metrics counts each router's own workers, as its help says: the cluster's is the sum
    # over the routers scraped.
    for router, ready in ((a, 1), (b, 0)):
        exposition = await router.get("/metrics")
        assert sample(exposition, "shoal_workers", state="ready") == ready
        assert "# HELP shoal_workers Workers connected to this router" in exposition


async def test_every_router_sees_the_jobs_waiting_in_redis(
    routers: Callable[[], RouterApp],
) -> None:
    a, b = routers(), routers()
    worker = connect(a.dispatcher, "wa", slots=1)
    await until(lambda: b.dispatcher.remote_workers(), "B to list A's worker")
    jobs: list[Job] = [
        a.dispatcher.submit(Submission(M, Endpoint.CHAT, False, {})) for _ in range(3)
    ]
    jobs.append(b.dispatcher.submit(Submission(M, Endpoint.CHAT, False, {})))
    await a.dispatcher.wait_assigned(jobs[0])  # the one slot; three wait in Redis
    assert worker.running.keys() == {jobs[0].id}

    def both_see(n: int) -> bool:
        return all(r.dispatcher.queue_depths().get(M, 0) == n for r in (a, b))

    await until(lambda: both_see(3), "both routers to count 3 waiting jobs")
    for router in (a, b):
        [model] = (await router.get("/v1/models"))["data"]
        assert model["queued"] == 3
        assert queue_depth(await router.get("/metrics"), M) == 3
    for job in jobs[1:]:
        (a if job in jobs[:3] else b).dispatcher.cancel(job, "test")
    await until(lambda: both_see(0), "the cancelled jobs to leave the count")
    assert queue_depth(await b.get("/metrics"), M) == 0


async def test_in_process_health_and_depths_are_this_routers(tmp_path: Path) -> None:
    settings = RouterSettings(database_url=f"sqlite:///{tmp_path}/keys.db")
    router = RouterApp(build_app(settings))
    dispatcher = router.ctx.dispatcher
    try:
        assert type(dispatcher) is MemoryDispatcher and dispatcher.queue_backend == "memory"
        connect(dispatcher, "w1", slots=1)
        first = dispatcher.submit(Submission(M, Endpoint.CHAT, False, {}))
        dispatcher.submit(Submission(M, Endpoint.CHAT, False, {}))
        dispatcher.submit(Submission(M, Endpoint.CHAT, False, {}))
        assert first.worker_id == "w1"
        assert (
            dict(dispatcher.queue_depths()) == {M: 2} and dispatcher.queue_depths().get(M, 0) == 2
        )
        health = await router.get("/health")
        [model] = (await router.get("/v1/models"))["data"]
        assert queue_depth(await router.get("/metrics"), M) == 2
    finally:
        await router.client.aclose()
        await router.ctx.accounting.limiter.close()
        if router.ctx.store is not None:
            router.ctx.store.close()
    assert health["queue"] == "memory" and health["workers"] == 1
    assert health["ready_workers"] == 1 and model["queued"] == 2


async def test_every_router_sees_what_each_workers_slots_hold(
    routers: Callable[[], RouterApp],
) -> None:
    """A worker's prefix summary travels through the worker directory (issue 15, item 3);
    a restarted llama-server's empty one too."""
    a, b = routers(), routers()
    worker = connect(a.dispatcher, "wa")
    a.dispatcher.workers.on_message(worker, CacheChanged(blocks=(11, 12, 13)))
    a.dispatcher.directory.changed()

    def held() -> frozenset[int] | None:
        remote = b.dispatcher.remote_workers()
        return remote[0].cached if remote else None

    await until(lambda: held() == {11, 12, 13}, "B to see A's worker's prefix blocks")
    a.dispatcher.workers.on_message(worker, CacheChanged(blocks=()))
    a.dispatcher.directory.changed()
    await until(lambda: held() == frozenset(), "B to see them cleared")


async def test_what_a_worker_holds_reaches_the_other_routers_promptly(
    routers: Callable[..., RouterApp],
) -> None:
    """A slot's new holding is pushed to Redis within ``PUSH_GAP_S``, not at the (here
    6 s) directory interval, and the other router holds a job with that prefix for it."""
    a, b = routers(heartbeat_interval=6.0), routers()
    worker = connect(a.dispatcher, "wa", slots=2)
    await until(lambda: b.dispatcher.remote_workers(), "B to list A's worker (join: at once)")
    chain = tuple(range(11, 21))  # ten blocks: ~640 tokens, worth waiting for
    assert b.dispatcher.directory.hold_for(M, Endpoint.CHAT, chain) is None  # held nowhere
    started = asyncio.get_running_loop().time()
    a.dispatcher.workers.on_message(worker, CacheChanged(blocks=chain))
    await until(
        lambda: b.dispatcher.remote_workers()[0].cached == frozenset(chain),
        "B to see what A's worker's slots hold",
    )
    assert asyncio.get_running_loop().time() - started < 2.0  # not A's 6 s interval
    assert b.dispatcher.directory.hold_for(M, Endpoint.CHAT, chain) == a.dispatcher.name
    assert a.dispatcher.directory.hold_for(M, Endpoint.CHAT, chain) == a.dispatcher.name
    assert b.dispatcher.directory.hold_for(M, Endpoint.CHAT, chain[:2]) is None  # too short


class PullEntry:
    """A pull worker's entry in the worker list, written by the real ``Presence`` with the
    real ``summary`` (no llama-server: ``cached`` and ``running`` stand for its slots)."""

    def __init__(self, redis: aioredis.Redis, prefix: str, name: str) -> None:
        self.cached: tuple[int, ...] = ()
        self.running = 0
        self.gpus: tuple[GpuSample, ...] = ()
        self.consumer = consumer_name(name)
        self.register = Register(
            protocol_version=PROTOCOL_VERSION,
            worker_id=WorkerId(name),
            name=name,
            hardware=Hardware(
                hostname=name, os="linux", cpu_count=2, ram_total_bytes=1, ram_available_bytes=1
            ),
            models=(ModelInfo(name=M, endpoints=(Endpoint.CHAT,)),),
            slots=2,
            state=BackendState.READY,
        )
        self.presence = Presence(redis, prefix, name, self.describe, interval_s=6.0)

    async def describe(self) -> dict[str, object]:
        return summary(
            self.register,
            detail="",
            running_jobs=self.running,
            ram_available_bytes=1,
            gpu_free_bytes=(),
            connected_at=0.0,
            consumer=self.consumer,
            cached_blocks=self.cached,
            gpu_telemetry=self.gpus,
        )


async def test_a_job_is_held_for_the_pull_worker_holding_its_prefix(
    routers: Callable[..., RouterApp], redis_prefix: str
) -> None:
    """A pull worker's entry names its consumer: a router holds a job whose prefix its slots
    hold for that name, the one it claims under (issue 15, item 3). What its slots hold is
    pushed within ``PUSH_GAP_S``, not at its (here 6 s) interval."""
    router = routers()
    redis = aioredis.Redis(host="127.0.0.1", port=6379)
    p1, p2 = PullEntry(redis, redis_prefix, "p1"), PullEntry(redis, redis_prefix, "p2")
    body = {"messages": [{"role": "system", "content": "Rule 1 of tenant-a. " * 100}]}
    chain = prefix_chain(M, body)
    assert len(chain) >= 6  # ~400 tokens: worth a hold
    directory = router.dispatcher.directory
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(p.presence.run()) for p in (p1, p2)]
        await until(lambda: len(router.dispatcher.remote_workers()) == 2, "both entries listed")
        assert directory.hold_for(M, Endpoint.CHAT, chain) is None  # held nowhere yet
        started = asyncio.get_running_loop().time()
        p1.cached, p2.cached = chain, chain[:2]
        for p in (p1, p2):
            p.presence.soon()
        await until(lambda: directory.hold_for(M, Endpoint.CHAT, chain), "p1's holding to arrive")
        assert asyncio.get_running_loop().time() - started < 2.0  # not the 6 s interval
        assert directory.hold_for(M, Endpoint.CHAT, chain) == p1.consumer  # not "pull"
        # The job's hold in Redis names p1's consumer: TAKE gives it to p1 alone for a while.
        job = router.dispatcher.submit(Submission(M, Endpoint.CHAT, False, body))
        key = RedisKeys(redis_prefix).job(job.id)

        async def held_for() -> bytes | None:
            return await redis.hget(key, "for")  # type: ignore[no-any-return]

        async with asyncio.timeout(WAIT_S):
            while (got := await held_for()) is None:
                await asyncio.sleep(0.02)
        assert got == p1.consumer.encode()
        router.dispatcher.cancel(job, "test")
        # Full, p1 is held for no more (its running count is pushed the same way).
        p1.running = 2
        p1.presence.soon()
        await until(
            lambda: directory.hold_for(M, Endpoint.CHAT, chain) is None, "p1 full to arrive"
        )
        for task in tasks:
            task.cancel()
    await redis.aclose()


async def test_a_router_reads_the_worker_list_as_a_job_it_sent_ends(
    routers: Callable[..., RouterApp], redis_prefix: str
) -> None:
    """A router with no worker of its own syncs at its (here 6 s) interval; a job it sent
    ending elsewhere (here on a pull worker's consumer) makes it read the worker list within
    ``PUSH_GAP_S``, so the pull worker's new holding counts for the tenant's next request."""
    redis = aioredis.Redis(host="127.0.0.1", port=6379)
    p1 = PullEntry(redis, redis_prefix, "p1")
    body = {"messages": [{"role": "system", "content": "Rule 1 of tenant-a. " * 100}]}
    chain = prefix_chain(M, body)
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(p1.presence.run())
        while not await redis.exists(p1.presence.key):
            await asyncio.sleep(0.02)
        router = routers(heartbeat_interval=6.0)  # its first sync lists p1, holding nothing
        await until(lambda: router.dispatcher.remote_workers(), "the router to list p1")
        p1.cached = chain  # the first request's prompt, now in p1's slots
        p1.presence.soon()
        job = router.dispatcher.submit(Submission(M, Endpoint.CHAT, False, {}))
        claimer = RedisJobQueue(redis, redis_prefix, p1.consumer)
        [claimed] = await claimer.claim([(M, Endpoint.CHAT)], 1, 5000)
        await asyncio.sleep(0.3)  # p1's entry is written
        ended = asyncio.get_running_loop().time()
        await claimer.publish(claimed, events.Done())
        await until(
            lambda: router.dispatcher.directory.hold_for(M, Endpoint.CHAT, chain),
            "the router to read p1's holding",
        )
        assert asyncio.get_running_loop().time() - ended < 2.0  # not the 6 s interval
        assert router.dispatcher.directory.hold_for(M, Endpoint.CHAT, chain) == p1.consumer
        assert job.state.finished
        task.cancel()
    await redis.aclose()


# ------------------------------------------------------------------ GPU telemetry

H100 = GpuSample(
    index=0,
    uuid="GPU-0",
    name="NVIDIA H100 80GB HBM3",
    utilization_percent=37.0,
    memory_used_bytes=72790 << 20,
    memory_total_bytes=81559 << 20,
    temperature_celsius=39.0,
    power_watts=145.0,
    power_limit_watts=700.0,
)


def beat(dispatcher: Dispatcher, worker: WorkerConnection, *gpus: GpuSample) -> None:
    """``worker``'s heartbeat, as the router's worker side receives it."""
    message = Heartbeat(
        state=BackendState.READY, running_jobs=0, ram_available_bytes=1, gpu_telemetry=gpus
    )
    dispatcher.workers.on_message(worker, message)


def gpu_series(exposition: str) -> dict[tuple[str, str, str], float]:
    """``(gauge, worker, gpu) -> value`` of the ``shoal_gpu_*`` samples."""
    return {
        (s.name, s.labels["worker"], s.labels["gpu"]): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
        if s.name.startswith("shoal_gpu_")
    }


async def test_a_router_shows_each_gpu_of_its_workers_as_their_last_heartbeat_said(
    tmp_path: Path,
) -> None:
    """Gauges built at scrape time from each worker's latest heartbeat, labelled by its name
    (its id where two share a name); the worker list carries the samples; a worker that
    leaves takes its series with it."""
    settings = RouterSettings(database_url=f"sqlite:///{tmp_path}/keys.db")
    router = RouterApp(build_app(settings))
    dispatcher = router.ctx.dispatcher
    cpu, rig = worker_connection("cpu-box"), worker_connection("rig")
    twins = [worker_connection("twin", worker_id=f"twin-{n}") for n in (1, 2)]
    try:
        for worker in (cpu, rig, *twins):
            dispatcher.workers.on_registered(worker)
            beat(dispatcher, worker)  # no GPU: nothing
        beat(dispatcher, rig, H100.model_copy(update={"power_watts": 90.0}))
        beat(dispatcher, rig, H100, GpuSample(index=1, temperature_celsius=30.0))
        for twin in twins:
            beat(dispatcher, twin, H100)
        series = gpu_series(await router.get("/metrics"))
        listed = {w["name"] + w["id"]: w for w in (await router.get("/api/v1/workers"))["data"]}
        dispatcher.workers.on_lost(rig, "test")
        after = gpu_series(await router.get("/metrics"))
    finally:
        await router.client.aclose()
        await router.ctx.accounting.limiter.close()
        if router.ctx.store is not None:
            router.ctx.store.close()
    assert series[("shoal_gpu_power_watts", "rig", "0")] == 145  # the latest heartbeat's
    assert series[("shoal_gpu_utilization_ratio", "rig", "0")] == 0.37
    assert series[("shoal_gpu_temperature_celsius", "rig", "1")] == 30
    assert ("shoal_gpu_power_watts", "rig", "1") not in series  # unknown: no series
    assert {w for _, w, _ in series} == {"rig", "twin-1", "twin-2"}
    assert listed["rigrig"]["gpu_telemetry"] == [
        H100.model_dump(mode="json"),
        GpuSample(index=1, temperature_celsius=30.0).model_dump(mode="json"),
    ]
    assert listed["cpu-boxcpu-box"]["gpu_telemetry"] == []
    assert {w for _, w, _ in after} == {"twin-1", "twin-2"}


async def test_gpu_telemetry_rides_the_worker_list_and_each_router_gauges_its_own(
    routers: Callable[[], RouterApp], redis_prefix: str
) -> None:
    """With Redis, every router lists every worker's GPUs (its router's and pull workers'
    entries carry them); each router's gauges are its own workers', as ``shoal_workers``."""
    a, b = routers(), routers()
    redis = aioredis.Redis(host="127.0.0.1", port=6379)
    pull = PullEntry(redis, redis_prefix, "p1")
    pull.gpus = (H100.model_copy(update={"name": "AMD Instinct MI300X"}),)
    rig = connect(a.dispatcher, "rig")
    beat(a.dispatcher, rig, H100)
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(pull.presence.run())
        a.dispatcher.directory.changed()

        async def telemetry(router: RouterApp) -> dict[str, object]:
            workers = (await router.get("/api/v1/workers"))["data"]
            return {w["name"]: w["gpu_telemetry"] for w in workers}

        async def listed() -> bool:
            return len(await telemetry(b)) == 2 and len(await telemetry(a)) == 2

        async with asyncio.timeout(WAIT_S):
            while not await listed():
                await asyncio.sleep(0.05)
        for router in (a, b):
            assert await telemetry(router) == {
                "rig": [H100.model_dump(mode="json")],
                "p1": [pull.gpus[0].model_dump(mode="json")],
            }
        task.cancel()
    await redis.aclose()
    assert {w for _, w, _ in gpu_series(await a.get("/metrics"))} == {"rig"}
    assert gpu_series(await b.get("/metrics")) == {}
