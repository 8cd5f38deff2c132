"""Where stored responses (the Responses API's ``store: true``) live: one ``ResponseStore``
protocol, kept in this router (``MemoryResponseStore``, lost on restart) or in Redis
(``RedisResponseStore``, read by every router on the same Redis and prefix, so a follow-up
with ``previous_response_id`` may reach any of them). Both forget a response ``ttl_s``
seconds after it was stored (the router's ``--job-ttl``). What is stored and how a
follow-up is made of it is ``stored_responses.py``'s.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeVar

import orjson
import redis.asyncio as aioredis
import redis.exceptions

from shoal.queue.redis_keys import stored_response_key
from shoal.router.errors import Unavailable

MEMORY_MAX_RESPONSES = 10_000
"""The most responses a router keeps in memory; past it the oldest go first."""
REDIS_CALL_TIMEOUT_S = 2.0
"""A store call slower than this counts as Redis being down (503)."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StoredResponse:
    owner: str | None
    """The id of the key that created it (None: a flag key or open access); only a request
    with the same key reads, continues or deletes it."""
    response: dict[str, Any]
    """The response object, as the client got it."""
    items: list[dict[str, Any]]
    """The conversation through this response: every input item it was given (those of the
    responses before it included), then its output items."""

    @property
    def id(self) -> str:
        return str(self.response["id"])


class ResponseStore(Protocol):
    async def put(self, stored: StoredResponse) -> None: ...

    async def get(self, response_id: str) -> StoredResponse | None:
        """The response, or None when it was never stored, was deleted or expired."""

    async def delete(self, response_id: str) -> bool:
        """Forget it; False when there was nothing to forget."""


class MemoryResponseStore:
    def __init__(self, ttl_s: float, max_responses: int = MEMORY_MAX_RESPONSES) -> None:
        self.ttl_s = ttl_s
        self.max_responses = max_responses
        self._kept: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    async def put(self, stored: StoredResponse) -> None:
        self._kept[stored.id] = (time.monotonic() + self.ttl_s, stored)
        self._kept.move_to_end(stored.id)
        while len(self._kept) > self.max_responses:
            self._kept.popitem(last=False)

    async def get(self, response_id: str) -> StoredResponse | None:
        kept = self._kept.get(response_id)
        if kept is None:
            return None
        if kept[0] <= time.monotonic():
            del self._kept[response_id]
            return None
        return kept[1]

    async def delete(self, response_id: str) -> bool:
        return await self.get(response_id) is not None and bool(self._kept.pop(response_id))


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
