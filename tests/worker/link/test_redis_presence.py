"""A pull worker's entry in the worker list (``worker/link/redis_presence.py``) on the real Redis at
127.0.0.1:6379: ``soon()`` (a job started or ended, the slots hold something new) writes it
promptly but at most every ``PUSH_GAP_S``; ``changed()`` writes it at once."""

from __future__ import annotations

import asyncio

import orjson
import redis.asyncio as aioredis

from shoal.redis_queue.keys import worker_key
from shoal.worker.link.redis_presence import PUSH_GAP_S, Presence


async def test_soon_pushes_promptly_and_bounded_in_rate(redis_prefix: str) -> None:
    redis = aioredis.Redis(host="127.0.0.1", port=6379)
    writes: list[float] = []
    loop = asyncio.get_running_loop()

    async def describe() -> dict[str, object]:
        writes.append(loop.time())
        return {"n": len(writes)}

    presence = Presence(redis, redis_prefix, "p1", describe, interval_s=60.0)
    task = asyncio.create_task(presence.run())
    try:
        while not writes:
            await asyncio.sleep(0.01)
        started = loop.time()
        while loop.time() - started < 1.0:  # a change every 10 ms for a second
            presence.soon()
            await asyncio.sleep(0.01)
        pushed = [t for t in writes if t > started]
        # every PUSH_GAP_S (not at the 60 s interval), never more often
        assert 1.0 / PUSH_GAP_S - 2 <= len(pushed) <= 1.0 / PUSH_GAP_S + 1, pushed
        gaps = [b - a for a, b in zip(writes, writes[1:], strict=False)]
        assert min(gaps) >= PUSH_GAP_S - 0.02, gaps
        await asyncio.sleep(PUSH_GAP_S + 0.1)
        before = len(writes)
        presence.soon()
        async with asyncio.timeout(1.0):
            while len(writes) == before:
                await asyncio.sleep(0.005)
        presence.changed()  # state or models: at once, not PUSH_GAP_S after the last write
        async with asyncio.timeout(1.0):
            while len(writes) == before + 1:
                await asyncio.sleep(0.005)
        assert writes[-1] - writes[-2] < PUSH_GAP_S / 2, writes[-2:]
        raw = await redis.hget(worker_key(redis_prefix, "p1"), "summary")
        assert raw is not None and orjson.loads(raw) == {"n": len(writes)}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await redis.aclose()
