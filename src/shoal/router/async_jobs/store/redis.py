"""Async job records in Redis, shared by every router on the same Redis and prefix.

* **Keys** are named in ``job_key`` and ``cancel_channel`` only: ``{prefix}job:{id}`` is a hash
  per job whose fields are the record's fields, each a JSON value; ``{prefix}jobs:cancelled``
  is the channel on which cancels are announced.
* **Expiry**: a live record carries a long lease (``live_ttl_s``, refreshed when it starts
  running), so the record of a router that died mid-job does not stay forever; when the job
  ends the key's TTL becomes ``ttl_s``. Redis drops it then; nothing here sweeps.
* **Transitions** are one Lua script: it moves the status only if the current one allows it
  (``records.ALLOWED``), so a cancel and the job's end racing on two routers have one winner.
* **Cancels reach the router running the job**: ``cancel`` publishes the id, and ``run``
  (a blocking subscription, no polling) hands each id to the jobs service, which cancels its
  task if it runs here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import orjson
import redis.asyncio as aioredis
import redis.exceptions

from shoal.redis_queue.keys import async_job_cancel_channel, async_job_key
from shoal.router.async_jobs.records import ALLOWED, AsyncJobId, JobRecord, JobStatus, JobType
from shoal.router.async_jobs.store.interface import (
    DEFAULT_JOB_TTL_S,
    Cancellation,
    JobStoreUnavailable,
)

log = logging.getLogger(__name__)

LIVE_TTL_S = 24 * 3600.0
"""Longest a queued or running record is kept (a router that dies mid-job never ends it)."""
REDIS_CALL_TIMEOUT_S = 2.0
"""A store call slower than this counts as Redis being down (the client gets a 503)."""
RESUBSCRIBE_S = 5.0
"""After the cancel subscription breaks, wait this long before subscribing again."""

_DOWN_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)

# KEYS[1]: the job's hash. ARGV[1]: new status (JSON), ARGV[2]: TTL in ms, ARGV[3]: n, the
# count of statuses it may move from; ARGV[4 .. 3+n]: those (JSON); then field/value pairs.
# Returns {moved (0 or 1), field, value, ...} (the record after), or {} if there is none.
_TRANSITION = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {} end
local n = tonumber(ARGV[3])
local moved = 0
for i = 4, 3 + n do
  if ARGV[i] == status then moved = 1 end
end
if moved == 1 then
  redis.call('HSET', KEYS[1], 'status', ARGV[1], unpack(ARGV, 4 + n))
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
local all = redis.call('HGETALL', KEYS[1])
table.insert(all, 1, moved)
return all
"""

# KEYS[1]: the job's hash. ARGV[1]: the status it must have (JSON), ARGV[2]: the field,
# ARGV[3]: its value (JSON). Progress is kept while running, the queue position while queued.
_SET_WHILE = """
if redis.call('HGET', KEYS[1], 'status') == ARGV[1] then
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
end
return 0
"""

T = TypeVar("T")


def job_key(prefix: str, job_id: str) -> str:
    """The hash that holds one job's record."""
    return async_job_key(prefix, job_id)


def cancel_channel(prefix: str) -> str:
    """The channel every router listens on for cancelled job ids."""
    return async_job_cancel_channel(prefix)


def to_fields(record: JobRecord) -> dict[str, str]:
    """The record as hash fields, each value JSON."""
    return {
        "id": _json(record.id),
        "type": _json(record.type.value),
        "model": _json(record.model),
        "owner": _json(record.owner),
        "created_at": _json(record.created_at),
        "status": _json(record.status.value),
        "finished_at": _json(record.finished_at),
        "expires_at": _json(record.expires_at),
        "result": _json(record.result),
        "error": _json(record.error),
        "progress": _json(record.progress),
        "queue_position": _json(record.queue_position),
    }


def from_fields(fields: Mapping[str, Any]) -> JobRecord:
    """The record from its hash fields (as ``to_fields`` wrote them)."""
    v = {name: orjson.loads(value) for name, value in fields.items()}
    return JobRecord(
        id=AsyncJobId(v["id"]),
        type=JobType(v["type"]),
        model=v["model"],
        owner=v["owner"],
        created_at=v["created_at"],
        status=JobStatus(v["status"]),
        finished_at=v.get("finished_at"),
        expires_at=v.get("expires_at"),
        result=v.get("result"),
        error=v.get("error"),
        progress=v.get("progress"),
        queue_position=v.get("queue_position"),
    )


def _json(value: object) -> str:
    return orjson.dumps(value).decode()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _pairs(flat: Sequence[Any]) -> dict[str, Any]:
    return {_text(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}


def _flat(fields: dict[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]


def _raise_if_cancelled() -> None:
    """Raise the cancel that redis-py swallowed, if it did.

    A cancel that lands while redis-py (8.x) connects (seen in ``PubSub.subscribe``) can be
    absorbed: the call returns normally and the task, still ``cancelling()``, goes on; the
    cancel listener would then block on its next read forever, hanging shutdown. So every
    call here checks afterwards.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class RedisJobStore:
    """``JobStore`` shared by all routers that use the same Redis and ``prefix``."""

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        ttl_s: float = DEFAULT_JOB_TTL_S,
        *,
        live_ttl_s: float = LIVE_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.live_ttl_s = max(live_ttl_s, ttl_s)
        self.clock = clock
        self._redis = redis
        self._transition = redis.register_script(_TRANSITION)
        self._set_while = redis.register_script(_SET_WHILE)
        self.subscribed = asyncio.Event()
        """Set while ``run`` is subscribed to cancels (tests wait for it)."""

    async def create(self, record: JobRecord) -> None:
        key = job_key(self.prefix, record.id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, items=_flat(to_fields(record)))
            pipe.pexpire(key, _ms(self.live_ttl_s))
            await self._call(pipe.execute())

    async def get(self, job_id: AsyncJobId) -> JobRecord | None:
        fields = await self._call(self._redis.hgetall(job_key(self.prefix, job_id)))
        if not fields:
            return None
        return from_fields({_text(k): v for k, v in fields.items()})

    async def set_running(self, job_id: AsyncJobId) -> JobRecord | None:
        moved, record = await self._move(job_id, JobStatus.RUNNING, self.live_ttl_s, [])
        return record if moved else None

    async def finish(
        self,
        job_id: AsyncJobId,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> JobRecord | None:
        if (result is None) == (error is None):
            raise ValueError("a finished job has a result or an error, not both or neither")
        new = JobStatus.SUCCEEDED if error is None else JobStatus.FAILED
        moved, record = await self._move(job_id, new, self.ttl_s, self._ending(result, error))
        if not moved and record is not None and not ALLOWED.terminal(record.status):
            ALLOWED.check(f"async job {job_id}", record.status, new)  # raises: not allowed
        return record if moved else None

    async def cancel(self, job_id: AsyncJobId) -> Cancellation:
        moved, record = await self._move(
            job_id, JobStatus.CANCELLED, self.ttl_s, self._ending(None, None)
        )
        if moved:
            await self._call(self._redis.publish(cancel_channel(self.prefix), job_id))
        return Cancellation(record, cancelled=moved)

    async def set_progress(self, job_id: AsyncJobId, progress: dict[str, Any]) -> None:
        running = _json(JobStatus.RUNNING.value)
        key = job_key(self.prefix, job_id)
        await self._call(self._set_while(keys=[key], args=[running, "progress", _json(progress)]))

    async def set_queue_position(self, job_id: AsyncJobId, place: int) -> None:
        queued = _json(JobStatus.QUEUED.value)
        key = job_key(self.prefix, job_id)
        await self._call(self._set_while(keys=[key], args=[queued, "queue_position", _json(place)]))

    async def run(self, on_cancel: Callable[[AsyncJobId], None]) -> None:
        """Hand every cancelled job id (from any router) to ``on_cancel``, until cancelled.

        While Redis is unreachable, cancels made on other routers do not reach this one (their
        records are cancelled all the same); the subscription is retried every RESUBSCRIBE_S.
        """
        while True:
            try:
                await self._listen(on_cancel)
            except _DOWN_ERRORS as exc:
                log.warning(
                    "async jobs: lost the Redis subscription to cancels (%s: %s); retrying in %ss",
                    type(exc).__name__,
                    exc,
                    RESUBSCRIBE_S,
                )
            await asyncio.sleep(RESUBSCRIBE_S)  # back-off before reconnecting, not a poll

    async def _listen(self, on_cancel: Callable[[AsyncJobId], None]) -> None:
        async with self._redis.pubsub(ignore_subscribe_messages=True) as pubsub:
            await pubsub.subscribe(cancel_channel(self.prefix))
            _raise_if_cancelled()
            self.subscribed.set()
            try:
                async for message in pubsub.listen():
                    _raise_if_cancelled()
                    if message.get("type") == "message":
                        on_cancel(AsyncJobId(_text(message["data"])))
            finally:
                self.subscribed.clear()

    def _ending(self, result: dict[str, Any] | None, error: dict[str, Any] | None) -> list[str]:
        now = self.clock()
        fields = {
            "finished_at": _json(now),
            "expires_at": _json(now + self.ttl_s),
            "result": _json(result),
            "error": _json(error),
        }
        return _flat(fields)

    async def _move(
        self, job_id: AsyncJobId, new: JobStatus, ttl_s: float, fields: list[str]
    ) -> tuple[bool, JobRecord | None]:
        allowed = [_json(s.value) for s in ALLOWED.sources(new)]
        args: list[str | int] = [_json(new.value), _ms(ttl_s), len(allowed), *allowed, *fields]
        reply = await self._call(self._transition(keys=[job_key(self.prefix, job_id)], args=args))
        if not reply:
            return False, None
        record = from_fields(_pairs(reply[1:]))
        if reply[0]:
            log.info("async job %s model=%s: -> %s", job_id, record.model, new)
        return bool(reply[0]), record

    async def _call(self, call: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(REDIS_CALL_TIMEOUT_S):
                reply = await call
        except (*_DOWN_ERRORS, TimeoutError) as exc:
            log.warning("async jobs: Redis unreachable (%s: %s)", type(exc).__name__, exc)
            raise JobStoreUnavailable(
                "The async jobs store (Redis) is unreachable right now; retry shortly. "
                "Operators: check Redis (see the router log).",
                retry_after=RESUBSCRIBE_S,
            ) from None
        _raise_if_cancelled()
        return reply
