"""Stored responses in Redis, shared by every router on the same Redis and prefix."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import asdict
from typing import TypeVar

import orjson
import redis.asyncio as aioredis
import redis.exceptions

from shoal.redis_queue.keys import stored_response_key
from shoal.router.errors import Unavailable
from shoal.router.responses.store.interface import StoredResponse

REDIS_CALL_TIMEOUT_S = 2.0
"""A store call slower than this counts as Redis being down (503)."""

T = TypeVar("T")


class RedisResponseStore:
    """One string per response, ``{prefix}resp:{id}``: the JSON of its ``StoredResponse``,
    with the TTL on the key (Redis drops it; nothing here sweeps)."""

    def __init__(self, redis: aioredis.Redis, prefix: str, ttl_s: float) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s

    async def put(self, stored: StoredResponse) -> None:
        value = orjson.dumps(asdict(stored))
        key = stored_response_key(self.prefix, stored.id)
        await self._call(self.redis.set(key, value, px=max(1, int(self.ttl_s * 1000))))

    async def get(self, response_id: str) -> StoredResponse | None:
        raw = await self._call(self.redis.get(stored_response_key(self.prefix, response_id)))
        if raw is None:
            return None
        fields = orjson.loads(raw)
        return StoredResponse(fields["owner"], fields["response"], fields["items"])

    async def delete(self, response_id: str) -> bool:
        removed = await self._call(self.redis.delete(stored_response_key(self.prefix, response_id)))
        return bool(removed)

    async def _call(self, call: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(REDIS_CALL_TIMEOUT_S):
                return await call
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, TimeoutError):
            raise Unavailable(
                "The store of responses (Redis) does not answer; retry shortly.", retry_after=2
            ) from None
