"""How the Redis job queue talks to Redis: its Lua scripts by name, every call riding out an
outage.

Every script of ``redis_scripts`` (and ``redis_claim``'s ``TAKE``) that works on jobs takes the same
leading arguments (the group, this consumer, the key prefixes, the output stream's limits);
``QueueCalls.run`` prepends them. Every call, scripted or not, goes through ``retry``: it is retried
with backoff for ``outage_s`` while Redis is unreachable (``redis_support.retrying``), which is safe
because each step is idempotent, and the outage is logged once (``OutageLog``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.typing import EncodableT

from shoal.queue import redis_claim, redis_scripts
from shoal.queue.redis_keys import (
    FINISHED_TTL_MS,
    GROUP,
    OUT_MAXLEN,
    OUT_SUFFIX,
    OUT_TTL_MS,
    RedisKeys,
)
from shoal.queue.redis_support import OutageLog, retrying

T = TypeVar("T")

SCRIPTS = ("ENQUEUE", "TAKE", "POSITIONS", "RECLAIM", "RENEW", "PUBLISH") + (
    "ACK",
    "GIVE_BACK",
    "GO_ON",
    "ADOPT",
    "CANCEL",
    "PRUNE",
)
"""The scripts ``run`` calls by name (with the common arguments first)."""


class QueueCalls:
    """One consumer's calls to Redis: ``run`` a job script, ``retry`` any other call."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RedisKeys,
        consumer: str,
        *,
        outage_s: float,
        outage: OutageLog,
    ) -> None:
        self.redis = redis
        self.outage_s = outage_s
        self.outage = outage
        self._common: list[EncodableT] = [
            GROUP,
            consumer,
            keys.job_key_prefix,
            OUT_SUFFIX,
            OUT_MAXLEN,
            OUT_TTL_MS,
            FINISHED_TTL_MS,
        ]
        self._scripts = {
            name: redis.register_script(
                redis_claim.TAKE if name == "TAKE" else getattr(redis_scripts, name)
            )
            for name in SCRIPTS
        }

    async def run(self, name: str, keys: Sequence[str], args: Iterable[EncodableT]) -> Any:
        """Run the script ``name`` (one of ``SCRIPTS``) with the common arguments first."""
        script: AsyncScript = self._scripts[name]
        argv = [*self._common, *args]
        return await self.retry(lambda: script(keys=keys, args=argv), name.lower())

    async def retry(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """``await call()``, again while Redis is unreachable, for up to ``outage_s``."""
        return await retrying(call, deadline_s=self.outage_s, what=what, outage=self.outage)
