"""Recovering the jobs of holders that stopped renewing their leases.

A consumer that stops renewing for a lease (it died, or lost Redis for that long) loses its
jobs: ``reclaim`` takes them over for this consumer, to run again, and ``sweep`` does it for
every queue without running anything (it puts them back in their queue), pruning consumers
gone for an hour. Either way a job that had published output is not run again: it fails with
a 502 (``LOST_AFTER_START``: the client already saw part of an answer), unless its trail
says exactly which tokens the client has and it has resume attempts left: then it goes back
to its queue with that continuation (``LOST_MID_ANSWER``), for another worker to go on.
Nothing is taken over within a lease of a Redis outage (``OutageLog.within``): holders get
to renew first.

``RedisJobQueue.reclaim`` and ``RedisJobQueue.sweep`` are the entry points; this module is
their machinery (the ``RECLAIM`` and ``PRUNE`` scripts, paged).
"""

from __future__ import annotations

import logging
from typing import Any

from redis.typing import EncodableT

from shoal.jobs import events
from shoal.jobs.events import Failed, Requeued
from shoal.protocol.messages import ErrorBody
from shoal.redis_queue.calls import QueueCalls
from shoal.redis_queue.keys import RedisKeys
from shoal.redis_queue.support import Sweep, text

log = logging.getLogger(__name__)

RECLAIM_BATCH = 100  # pending entries examined per XAUTOCLAIM
CONSUMER_IDLE_MS = 3600 * 1000  # a consumer given nothing for this long is pruned

LOST_AFTER_START = Failed(
    502,
    ErrorBody(
        message="The worker holding this job was lost after it had started answering; "
        "the answer is incomplete. Retry the request.",
        type="server_error",
        code="worker_lost",
    ),
)
LOST_BEFORE_START = Requeued("the worker holding this job was lost before it answered")
LOST_MID_ANSWER = Requeued("the worker holding this job was lost mid-answer; another goes on")

Row = list[Any]
"""A job taken over to run here, as the ``RECLAIM`` script returns it."""


class Recovery:
    def __init__(
        self,
        calls: QueueCalls,
        keys: RedisKeys,
        consumer: str,
        lease_ms: int,
        resume_attempts: int = 0,
    ) -> None:
        self.calls = calls
        self.keys = keys
        self.consumer = consumer
        self.lease_ms = lease_ms
        self.resume_attempts = resume_attempts

    async def take_over(self, queues: list[str], count: int, min_idle_ms: int | None) -> list[Row]:
        """Up to ``count`` jobs of ``queues`` whose holder has not renewed for
        ``min_idle_ms`` (default: the lease), to run here; the ones that had answered fail."""
        taken: list[Row] = []
        for queue in queues if count > 0 else ():
            if len(taken) >= count:
                break
            rows, _ = await self._reclaim(queue, count - len(taken), min_idle_ms, run=True)
            taken += [row[1:] for row in rows]
        return taken

    async def sweep(self, min_idle_ms: int | None) -> Sweep:
        """Put back (or fail) the lost jobs of every queue, and prune long-gone consumers."""
        failed = requeued = pruned = resumed = 0
        queues = await self.calls.retry(
            lambda: self.calls.redis.smembers(self.keys.queues), "sweep"
        )
        if self.calls.outage.within(self.lease_ms / 1000):
            log.info("sweep by %s put off: Redis was unreachable within a lease", self.consumer)
            return Sweep()
        for raw in queues:
            queue = text(raw)
            _, kinds = await self._reclaim(queue, None, min_idle_ms, run=False)
            failed += kinds.count("failed")
            requeued += kinds.count("requeued")
            resumed += kinds.count("resumed")
            pruned += int(await self.calls.run("PRUNE", [queue], [CONSUMER_IDLE_MS]))
        return Sweep(failed=failed, requeued=requeued, pruned=pruned, resumed=resumed)

    async def _reclaim(
        self, queue: str, count: int | None, min_idle_ms: int | None, *, run: bool
    ) -> tuple[list[Row], list[str]]:
        idle = self.lease_ms if min_idle_ms is None else min_idle_ms
        rows: list[Row] = []
        kinds: list[str] = []
        cursor = "0-0"
        while True:
            batch = RECLAIM_BATCH if count is None else min(RECLAIM_BATCH, count - len(rows))
            args: list[EncodableT] = [idle, batch, "1" if run else "0", cursor]
            args += [events.encode(LOST_AFTER_START), events.encode(LOST_BEFORE_START)]
            args += [self.resume_attempts, events.encode(LOST_MID_ANSWER)]
            reply = await self.calls.run("RECLAIM", [queue], args)
            cursor = text(reply[0])
            for row in reply[1:]:
                kind = text(row[0])
                kinds.append(kind)
                log.warning(
                    "job %s on %s taken over by %s: %s", text(row[1]), queue, self.consumer, kind
                )
                if kind == "run":
                    rows.append(row)
            if cursor == "0-0" or (count is not None and len(rows) >= count):
                return rows, kinds
