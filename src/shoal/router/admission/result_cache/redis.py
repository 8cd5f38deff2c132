"""``ResultCache`` in Redis, shared by every router (``--cache`` with ``--redis-url``)."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
import redis.exceptions

from shoal.redis_queue.keys import cache_entry_key
from shoal.router.admission.result_cache.interface import CachedAnswer

log = logging.getLogger(__name__)

REDIS_CALL_TIMEOUT_S = 0.25
"""A cache slower than this is treated as a miss: the worker is the fallback."""


_DOWN_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class RedisResultCache:
    """``ResultCache`` shared by every router on the same Redis and prefix; Redis expires
    entries after ``ttl_s`` (and evicts by its own ``maxmemory-policy``, if one is set)."""

    def __init__(self, redis: aioredis.Redis, prefix: str, ttl_s: float) -> None:
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._redis = redis
        self._down = False

    async def get(self, key: str) -> CachedAnswer | None:
        try:
            async with asyncio.timeout(REDIS_CALL_TIMEOUT_S):
                raw = await self._redis.get(cache_entry_key(self.prefix, key))
        except (*_DOWN_ERRORS, TimeoutError) as exc:
            self._mark_down(exc)
            return None
        self._mark_up()
        return None if raw is None else CachedAnswer.loads(raw)

    async def put(self, key: str, answer: CachedAnswer) -> None:
        ttl_ms = max(1, round(self.ttl_s * 1000))
        try:
            async with asyncio.timeout(REDIS_CALL_TIMEOUT_S):
                await self._redis.set(cache_entry_key(self.prefix, key), answer.dumps(), px=ttl_ms)
        except (*_DOWN_ERRORS, TimeoutError) as exc:
            self._mark_down(exc)
            return
        self._mark_up()

    def _mark_down(self, exc: BaseException) -> None:
        if not self._down:
            self._down = True
            log.warning(
                "result cache: Redis is unreachable (%s: %s); answering without the cache "
                "until it is back",
                type(exc).__name__,
                exc,
            )

    def _mark_up(self) -> None:
        if self._down:
            self._down = False
            log.info("result cache: Redis is reachable again")
