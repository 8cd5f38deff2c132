"""Pieces the Redis job queue is built from: its data types, errors, outage retry, replies.

**When Redis is down** every queue call raises ``redis.exceptions.ConnectionError`` (or
``TimeoutError``; both are in ``REDIS_DOWN``). Each queue call first rides out an outage for
the queue's ``outage_s`` (with ``retrying``), which is safe because every step is idempotent
(see ``scripts``). A caller that gets the error anyway should treat Redis as down:
stop taking new work, keep the jobs it holds running if it can, and retry the call with
backoff (``retrying`` again) rather than at once in a loop. Nothing is lost by waiting
as long as Redis keeps its data (AOF or RDB persistence): jobs, leases, consumer groups and
outputs are all in Redis. A holder that stays away longer than the lease loses its jobs to
another consumer when Redis is back; an outage itself does not count against the lease
(``sweep`` waits one lease after it: ``OutageLog.within``). ``OutageLog`` logs an outage
once as it starts and once as it ends, however many calls and loops see it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.exceptions

from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import Endpoint

log = logging.getLogger(__name__)

T = TypeVar("T")

REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
"""Errors that mean Redis is unreachable (``BusyLoadingError``, a Redis still loading its
data after a restart, is a ``ConnectionError``)."""

RETRY_FIRST_DELAY_S = 0.05
RETRY_MAX_DELAY_S = 2.0


class OutageLog:
    """Logs a Redis outage once as it starts and once as it ends, however many loops and
    calls see it: each reports its failures (``failed``) and successes (``succeeded``)
    here, and only the first failure and the first success after it are logged above
    DEBUG. A router shares one between its queue, output tail and worker directory."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._back_at = -math.inf

    @property
    def down(self) -> bool:
        return self._since is not None

    def within(self, seconds: float) -> bool:
        """Redis is down, or came back less than ``seconds`` ago.

        Lease idle times are not evidence of a dead holder then: nobody could renew while
        Redis was away (its clock ran on), so take-overs wait a lease after an outage."""
        return self.down or time.monotonic() - self._back_at < seconds

    def failed(self, what: str, exc: BaseException) -> None:
        if self._since is None:
            self._since = time.monotonic()
            log.warning("Redis unreachable (%s: %s); waiting for it to come back", what, exc)
        else:
            log.debug("%s: Redis still unreachable (%s)", what, exc)

    def succeeded(self) -> None:
        if self._since is not None:
            self._back_at = time.monotonic()
            log.warning("Redis reachable again after %.1f s", self._back_at - self._since)
            self._since = None


async def retrying(
    call: Callable[[], Awaitable[T]],
    *,
    deadline_s: float,
    what: str = "redis call",
    outage: OutageLog | None = None,
    first_delay_s: float = RETRY_FIRST_DELAY_S,
    max_delay_s: float = RETRY_MAX_DELAY_S,
) -> T:
    """``await call()``, again with exponential backoff while Redis is unreachable.

    The last try is at ``deadline_s``; if it fails too, its error is raised. Only for
    idempotent calls (every ``RedisJobQueue`` call is). The outage is logged by ``outage``
    (by default, once for this call).
    """
    outage = outage or OutageLog()
    deadline = time.monotonic() + deadline_s
    delay = first_delay_s
    while True:
        try:
            result = await call()
        except REDIS_DOWN as exc:
            outage.failed(what, exc)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, max_delay_s)
        else:
            outage.succeeded()
            return result


def raise_if_cancelled() -> None:
    """Re-raise a cancellation that redis-py swallowed.

    redis-py sends every command through ``asyncio.wait_for``, which on Python 3.11 returns
    normally when the task is cancelled just as the send completes (fixed in 3.12). The
    task still counts the request (``Task.cancelling()``), so a loop that checks after each
    call stops as it should instead of running on and hanging its task group's shutdown.
    The queue's own loops and ``claim`` check; never call it in cleanup code that runs
    while a cancellation is being handled (it would cut the cleanup short).
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class QueueFull(Exception):
    """Too many jobs for one (model, endpoint) queue; answer 429 and ask to retry later."""

    def __init__(self, model: ModelName, endpoint: Endpoint, depth: int, limit: int) -> None:
        super().__init__(
            f"{depth} requests are already queued or running for model {model!r} "
            f"({endpoint.value}), the limit is {limit}; retry later or add workers."
        )
        self.model = model
        self.endpoint = endpoint
        self.depth = depth
        self.limit = limit


class KeyQueueFull(Exception):
    """An API key has ``max_queued`` jobs waiting already (over every router): 429."""

    def __init__(self, tenant: str, waiting: int, cap: int) -> None:
        super().__init__(f"key {tenant} has {waiting} requests waiting; its max-queued is {cap}")
        self.tenant = tenant
        self.waiting = waiting
        self.cap = cap


class JobGone(Exception):
    """The job's record is gone from Redis (it expired, or never existed under this prefix)."""

    def __init__(self, job_id: JobId) -> None:
        super().__init__(
            f"job {job_id} is not in Redis: it expired or was never queued with this prefix"
        )
        self.job_id = job_id


class Lease(enum.Enum):
    """Whether a consumer still holds a job."""

    HELD = 1
    LOST = 0  # another consumer took it over, or it ended: stop working on it, do not ack
    CANCELLED = 2  # the client cancelled: stop working on it, then ack


LEASE_CODES = {1: Lease.HELD, 0: Lease.LOST, 2: Lease.CANCELLED}


class JobStatus(enum.StrEnum):
    """A job's state in Redis (the hash field ``state``), or MISSING."""

    WAITING = "waiting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    MISSING = "missing"


@dataclass(frozen=True, slots=True)
class QueuedJob:
    id: JobId
    model: ModelName
    endpoint: Endpoint
    stream: bool
    body: Mapping[str, Any]
    need: int = 0
    """The tokens of context a claimer's slot must have to be given it (0: any). A claim
    passes over a job that needs more than its limit (``claim``); a holder whose
    llama-server refused the prompt as too long gives it back needing more (``requeue``)."""


@dataclass(frozen=True, slots=True)
class Share:
    """Whom a job waits for, as the queue's fair scheduling needs it (``router/dispatch/
    fair_queue.Tenant`` and ``Job.work``, in Redis): the API key (``tenant``), its weight,
    whether it waits as batch work, its estimated work, whether the router schedules
    fairly (else first in, first out) and how many of the key's jobs may wait."""

    tenant: str = "anonymous"
    weight: float = 1.0
    batch: bool = False
    work: float = 1.0
    fair: bool = True
    max_queued: int | None = None


@dataclass(frozen=True, slots=True)
class QueueCounts:
    waiting: int
    running: int  # delivered to a consumer and not finished (includes holders that died)


@dataclass(frozen=True, slots=True)
class Waiting:
    """A queue's waiting jobs: how many, and how long the oldest has waited (seconds)."""

    count: int
    oldest_s: float


@dataclass(frozen=True, slots=True)
class Sweep:
    """What one ``sweep`` did: jobs failed (lost after answering), put back, consumers pruned."""

    failed: int = 0
    requeued: int = 0
    pruned: int = 0
    resumed: int = 0
    """Lost mid-answer, put back to go on from their trail."""


# ---------------------------------------------------------------- replies


def text(value: object) -> str:
    """A reply value as ``str`` whether the client decodes responses or not."""
    if isinstance(value, bytes):
        return value.decode()
    return str(value)


def stream_entries(reply: Any) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """``(stream, entry id, fields)`` from an XREAD/XREADGROUP reply, RESP2 or RESP3.

    RESP2 gives ``[[stream, [(id, fields), ...]], ...]``; RESP3 gives
    ``{stream: [[(id, fields), ...]]}``.
    """
    if not reply:
        return
    pairs = reply.items() if isinstance(reply, dict) else reply
    for stream, entries in pairs:
        if entries and isinstance(entries[0], list):
            entries = entries[0]
        for entry_id, fields in entries:
            yield text(stream), text(entry_id), {text(k): v for k, v in (fields or {}).items()}
