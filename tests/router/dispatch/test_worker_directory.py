"""The worker directory on a real Redis (``router/dispatch/directory.py``): an idle worker's
entry is only renewed, a changed one is written again, a lost one comes back."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import orjson
import pytest
import redis.asyncio as aioredis

from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import BackendState, Endpoint, ModelInfo
from shoal.redis_queue.keys import worker_key
from shoal.router.dispatch.directory import WorkerDirectory
from shoal.router.dispatch.job import Job
from shoal.router.dispatch.workers import Registry
from socketless import worker_connection

REDIS_URL = "redis://127.0.0.1:6379/0"
MODEL = ModelInfo(name=ModelName("m"), endpoints=(Endpoint.CHAT,))


@pytest.fixture
async def redis() -> AsyncIterator[tuple[aioredis.Redis, str]]:
    client = aioredis.Redis.from_url(REDIS_URL)
    prefix = f"shoal-test-{uuid.uuid4().hex[:10]}:"
    try:
        yield client, prefix
    finally:
        keys = [k async for k in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.unlink(*keys)
        await client.aclose()


async def test_an_unchanged_entry_is_renewed_a_changed_or_lost_one_written(
    redis: tuple[aioredis.Redis, str],
) -> None:
    client, prefix = redis
    registry = Registry()
    worker = worker_connection("w1", [MODEL])
    registry.add(worker)
    mine = WorkerDirectory(client, prefix, "router-a", registry, interval_s=5.0)
    other = WorkerDirectory(client, prefix, "router-b", Registry(), interval_s=5.0)
    key = worker_key(prefix, worker.id)

    await mine.sync()
    assert orjson.loads(await client.hget(key, "summary"))["state"] == "ready"
    assert mine.remote == []  # its own worker is not read back as another router's
    await client.hset(key, "summary", orjson.dumps({"state": "ready", "mark": 1}))
    await client.pexpire(key, 1000)
    await mine.sync()  # nothing changed: only the TTL is renewed
    assert orjson.loads(await client.hget(key, "summary"))["mark"] == 1
    assert await client.pttl(key) > 5000

    worker.set_backend_state(BackendState.LOADING, "test", None)
    await mine.sync()  # changed: written again
    assert orjson.loads(await client.hget(key, "summary"))["state"] == "loading"
    await other.sync()
    assert [(r.id, r.state) for r in other.remote] == [(worker.id, BackendState.LOADING)]

    await client.unlink(key)  # lost from Redis (flushed, or expired while this router hung)
    await mine.sync()  # its renewal finds nothing...
    await mine.sync()  # ...so it is written again
    assert orjson.loads(await client.hget(key, "summary"))["state"] == "loading"
    await other.sync()
    assert [r.id for r in other.remote] == [worker.id]


GB = 1 << 30


def text_model(name: str, state: BackendState) -> ModelInfo:
    return ModelInfo(
        name=ModelName(name),
        endpoints=(Endpoint.CHAT,),
        state=state,
        slots=1,
        resident_bytes=4 * GB,
    )


async def test_each_models_residency_reaches_the_other_routers(
    redis: tuple[aioredis.Redis, str],
) -> None:
    """A worker serving several text models: the other routers rank it by each model's own
    state, slots, running jobs and bytes, and its budget (``RemoteWorker.load``); a job of a
    model resident there is held for its router rather than loaded on another's worker."""
    client, prefix = redis
    registry = Registry()
    worker = worker_connection(
        "multi",
        [text_model("a", BackendState.READY), text_model("b", BackendState.UNLOADED)],
        model_budget_bytes=6 * GB,
    )
    registry.add(worker)
    mine = WorkerDirectory(client, prefix, "router-a", registry, interval_s=5.0)
    theirs = Registry()
    loads_it = worker_connection(
        "other", [text_model("a", BackendState.UNLOADED)], model_budget_bytes=6 * GB
    )
    theirs.add(loads_it)
    other = WorkerDirectory(client, prefix, "router-b", theirs, interval_s=5.0)

    await mine.sync()
    await other.sync()
    [remote] = other.remote
    load = remote.load()
    assert load.budget == 6 * GB
    assert [(m.name, m.state, m.slots, m.running, m.resident_bytes) for m in load.residency] == [
        ("a", BackendState.READY, 1, 0, 4 * GB),
        ("b", BackendState.UNLOADED, 1, 0, 4 * GB),
    ]
    assert other.hold_for(ModelName("a"), Endpoint.CHAT, ()) == "router-a"

    # a job of a runs there now: its one slot is taken, so nothing is held for it
    job = Job(JobId("j1"), ModelName("a"), Endpoint.CHAT, stream=False, body={})
    worker.hold(job.id, job)
    await mine.sync()
    await other.sync()
    [remote] = other.remote
    assert orjson.loads(await client.hget(worker_key(prefix, worker.id), "summary"))[
        "running_by_model"
    ] == {"a": 1, "b": 0}
    assert [m.running for m in remote.load().residency] == [1, 0]
    assert other.hold_for(ModelName("a"), Endpoint.CHAT, ()) is None
