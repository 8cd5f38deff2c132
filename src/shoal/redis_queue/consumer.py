"""What every consumer of the Redis job queue runs beside its claiming.

A consumer holds claimed jobs and produces their output: a router's ``Holder`` for its
WebSocket workers, or a pull-mode worker for its own slots. ``ConsumerLoops`` does the rest,
the same for both:

* publishes the output (``send``) in one round trip per batch: whatever piled up while the
  previous publish was in flight, after the ``Assigned`` event naming the worker that runs
  the job (the consumer sends it as it starts the job); ``GiveBack`` puts a job that
  published nothing back in its queue (one that had, fails with a 502);
* renews the leases on the jobs held every ``renew_interval_s``;
* follows cancellations from any router (``BLPOP``);
* sweeps the jobs of holders that died, twice per lease.

A job whose lease is lost (taken over, cancelled) or whose output could not be published is
stopped through ``HeldJobs.stop_job``; a cancelled one is acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from shoal.jobs import events
from shoal.protocol.ids import JobId
from shoal.protocol.messages import Continuation
from shoal.redis_queue.claimed import Claimed
from shoal.redis_queue.recovery import LOST_AFTER_START
from shoal.redis_queue.streams import RedisJobQueue
from shoal.redis_queue.support import REDIS_DOWN, RETRY_MAX_DELAY_S, Lease, raise_if_cancelled

log = logging.getLogger(__name__)

SWEEP_EVERY_LEASES = 0.5  # sweep for dead holders twice per lease


@dataclass(frozen=True, slots=True)
class GiveBack:
    """Put a job that published nothing back in its queue; or, with ``resume``, one that
    answered in part, to go on from there. ``need``: the tokens of context it needs from now
    on (its prompt was refused as too long), when more than before."""

    claimed: Claimed
    reason: str
    resume: Continuation | None = None
    need: int = 0


Outgoing = tuple[Claimed, events.Published] | GiveBack


class HeldJobs(Protocol):
    """The consumer's side: which claims it holds, and how to stop one of its jobs."""

    def held_claims(self) -> list[Claimed]: ...

    def stop_job(self, job_id: JobId) -> Claimed | None:
        """Stop the job here (cancelled, taken over) and free its slot; its claim, if held."""
        ...


def coalesce(
    items: list[tuple[Claimed, events.Published]],
) -> list[tuple[Claimed, events.Published]]:
    """One ``Trail`` per job per batch, after its other events (a batch is written in one
    step, so the trail still matches the output): its ids in order, exact as the last."""
    out: list[tuple[Claimed, events.Published]] = []
    trails: dict[JobId, tuple[Claimed, events.Trail]] = {}
    for claimed, event in items:
        if not isinstance(event, events.Trail):
            out.append((claimed, event))
            continue
        seen = trails.get(claimed.job.id)
        if seen is not None:
            first = seen[1]
            event = events.Trail(
                first.tokens + event.tokens,
                event.exact,
                first.answer_id or event.answer_id,
                first.created if first.created is not None else event.created,
            )
        trails[claimed.job.id] = (claimed, event)
    return out + list(trails.values())


class ConsumerLoops:
    def __init__(self, queue: RedisJobQueue, jobs: HeldJobs) -> None:
        self.queue = queue
        self.jobs = jobs
        self._outbox: list[Outgoing] = []
        self._flush = asyncio.Event()

    def send(self, item: Outgoing) -> None:
        self._outbox.append(item)
        self._flush.set()

    def take_pending(self) -> list[Outgoing]:
        """What is waiting to be published (a stopping consumer publishes it itself)."""
        batch, self._outbox = self._outbox, []
        return batch

    async def run_publisher(self) -> None:
        """Publish the outbox, one round trip per batch."""
        while True:
            await self._flush.wait()
            self._flush.clear()
            batch = self.take_pending()
            try:
                await self.publish(batch)
            except REDIS_DOWN as exc:
                # The events may or may not be written; their jobs stop here and the
                # sweep recovers them after the lease.
                log.error("could not publish %d events: %s", len(batch), exc)
                for item in batch:
                    claimed = item.claimed if isinstance(item, GiveBack) else item[0]
                    self.jobs.stop_job(claimed.job.id)
            raise_if_cancelled()

    async def publish(self, batch: list[Outgoing]) -> None:
        outputs = coalesce([item for item in batch if not isinstance(item, GiveBack)])
        leases = await self.queue.publish_many(outputs)
        for job_id, lease in leases.items():
            if lease is not Lease.HELD:
                await self._lost_lease(job_id, lease)
        for item in batch:
            if isinstance(item, GiveBack) and not await self._give_back(item):
                await self.queue.publish(item.claimed, LOST_AFTER_START)

    async def _give_back(self, item: GiveBack) -> bool:
        if item.resume is None:
            return await self.queue.requeue(item.claimed, item.reason, item.need)
        return await self.queue.go_on(item.claimed, item.reason, item.resume)

    async def _lost_lease(self, job_id: JobId, lease: Lease) -> None:
        claimed = self.jobs.stop_job(job_id)
        if claimed is not None and lease is Lease.CANCELLED:
            await self.queue.ack(claimed)

    async def run_renewals(self) -> None:
        while True:
            await asyncio.sleep(self.queue.renew_interval_s)
            try:
                leases = await self.queue.renew(self.jobs.held_claims())
            except REDIS_DOWN as exc:
                self.queue.outage.failed("renew", exc)
                continue
            raise_if_cancelled()
            for job_id, lease in leases.items():
                if lease is not Lease.HELD:
                    await self._lost_lease(job_id, lease)

    async def run_cancellations(self) -> None:
        while True:
            try:
                async for job_id in self.queue.cancellations():
                    claimed = self.jobs.stop_job(job_id)
                    if claimed is not None:
                        await self.queue.ack(claimed)
            except REDIS_DOWN as exc:
                self.queue.outage.failed("cancellations", exc)
                await asyncio.sleep(RETRY_MAX_DELAY_S)

    async def run_sweeps(self) -> None:
        """Recover jobs whose holder died: unstarted ones run again, started ones fail."""
        while True:
            await asyncio.sleep(self.queue.lease_ms / 1000 * SWEEP_EVERY_LEASES)
            try:
                swept = await self.queue.sweep()
            except REDIS_DOWN as exc:
                self.queue.outage.failed("sweep", exc)
                continue
            raise_if_cancelled()
            if swept.failed or swept.requeued:
                log.warning(
                    "sweep: %d job(s) of dead holders put back, %d failed",
                    swept.requeued,
                    swept.failed,
                )
