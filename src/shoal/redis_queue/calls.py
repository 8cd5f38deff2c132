"""How the Redis job queue talks to Redis: its Lua scripts by name, every call riding out an
outage.

Every script that works on jobs (``scripts``' waiting side, ``claim``'s ``TAKE``,
``leases``' holder side) takes the same leading arguments (the group, this consumer, the
key prefixes, the output stream's limits); ``QueueCalls.run`` prepends them. Every call,
scripted or not, goes through ``retry``: it is retried with backoff for ``outage_s`` while Redis
is unreachable (``support.retrying``), which is safe because each step is idempotent, and
the outage is logged once (``OutageLog``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.typing import EncodableT

from shoal.redis_queue import claim, leases, scripts
from shoal.redis_queue.keys import (
    FINISHED_TTL_MS,
    GROUP,
    OUT_MAXLEN,
    OUT_SUFFIX,
    OUT_TTL_MS,
    RedisKeys,
)
from shoal.redis_queue.support import OutageLog, retrying

T = TypeVar("T")

SCRIPTS: Mapping[str, str] = {
    "ENQUEUE": scripts.ENQUEUE,
    "POSITIONS": scripts.POSITIONS,
    "CANCEL": scripts.CANCEL,
    "TAKE": claim.TAKE,
    "RENEW": leases.RENEW,
    "PUBLISH": leases.PUBLISH,
    "ACK": leases.ACK,
    "GIVE_BACK": leases.GIVE_BACK,
    "GO_ON": leases.GO_ON,
    "ADOPT": leases.ADOPT,
    "RECLAIM": leases.RECLAIM,
    "PRUNE": leases.PRUNE,
}
"""The scripts ``run`` calls by name (with the common arguments first): the waiting side
(``scripts``), the claim (``claim``) and the holder's side (``leases``).
A name not listed here is a ``KeyError`` at the call, never a fallback."""


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
        self._scripts = {name: redis.register_script(lua) for name, lua in SCRIPTS.items()}

    async def run(self, name: str, keys: Sequence[str], args: Iterable[EncodableT]) -> Any:
        """Run the script ``name`` (one of ``SCRIPTS``) with the common arguments first."""
        script: AsyncScript = self._scripts[name]
        argv = [*self._common, *args]
        return await self.retry(lambda: script(keys=keys, args=argv), name.lower())

    async def retry(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """``await call()``, again while Redis is unreachable, for up to ``outage_s``."""
        return await retrying(call, deadline_s=self.outage_s, what=what, outage=self.outage)
