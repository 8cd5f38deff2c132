"""The worker directory on a real Redis (``router/dispatch/directory.py``): an idle worker's
entry is only renewed, a changed one is written again, a lost one comes back."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import orjson
import pytest
import redis.asyncio as aioredis

from shoal.protocol.ids import ModelName
from shoal.protocol.messages import BackendState, Endpoint, ModelInfo
from shoal.redis_queue.keys import worker_key
from shoal.router.dispatch.directory import WorkerDirectory
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
