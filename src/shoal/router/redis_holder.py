"""The Redis queue's consumer inside a router: its WebSocket workers run jobs from Redis.

One claim loop takes as many jobs as this router's workers have free slots, for every
(model, endpoint) they serve (a blocking ``XREADGROUP``; when no slot is free it waits for
one to free or a worker to join, without polling). Each job goes to a worker picked with
``pick_worker``; the worker's frames become output events, published in one round trip per
batch (whatever arrived while the previous publish was in flight). Leases are renewed every
``renew_interval_s``; cancellations from any router reach the worker as ``JobCancel``. Those
loops (publishing, renewals, cancellations, sweeps) are ``queue.redis_consumer.ConsumerLoops``,
the same a pull-mode worker runs; this class says what it holds and how to stop a job.

A retryable failure, or a lost worker, puts a job that published nothing back in its queue
(another worker anywhere runs it); a job that had answered in part fails with a 502. A
periodic ``sweep`` puts back the jobs of holders that died (another router, or this one
before a restart), so they run again. New (model, endpoint) pairs are claimed from the next
blocking read on (at most ``block_ms`` later).

A worker whose router died mid-answer reconnects here listing the jobs it still runs
(``reattach``): each one still running as that attempt is adopted (``RedisJobQueue.adopt``,
before the dead router's lease runs out) and the worker told to resume it from the first
chunk Redis does not have (``JobResume``), so the client's stream goes on with nothing lost
or repeated; the others are cancelled on the worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import (
    Endpoint,
    ErrorBody,
    JobCancel,
    JobFailed,
    JobResume,
    JobStart,
    RunningJob,
)
from shoal.queue import events
from shoal.queue.redis_consumer import ConsumerLoops, GiveBack, Outgoing
from shoal.queue.redis_streams import Claimed, RedisJobQueue
from shoal.queue.redis_support import REDIS_DOWN, raise_if_cancelled
from shoal.router.jobs import Job, JobState
from shoal.router.scheduler import pick_worker
from shoal.router.workers import Registry, WorkerConnection

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Held:
    """A claimed job running on one of this router's workers."""

    claimed: Claimed
    job: Job  # the stand-in in ``worker.running`` (slot counting, /api/v1/workers)
    worker: WorkerConnection
    started: bool = False  # output was published: it can no longer run again


class Holder:
    """Claims jobs for this router's workers and relays their output to Redis."""

    def __init__(self, queue: RedisJobQueue, registry: Registry, max_requeues: int) -> None:
        self.queue = queue
        self.registry = registry
        self.max_requeues = max_requeues
        self._held: dict[JobId, Held] = {}
        self._unplaced: deque[Claimed] = deque()  # claimed, no free worker for it yet
        self._capacity = asyncio.Event()
        self.loops = ConsumerLoops(queue, self)
        self._adoptions: asyncio.Queue[tuple[WorkerConnection, tuple[RunningJob, ...]]]
        self._adoptions = asyncio.Queue()

    # ------------------------------------------------------------ claiming

    def claimable(self) -> tuple[list[tuple[ModelName, Endpoint]], int]:
        """The pairs this router's workers serve, and how many more jobs they can take."""
        keys: set[tuple[ModelName, Endpoint]] = set()
        free = 0
        for w in self.registry:
            if w.available:
                keys |= w.served
                free += max(w.slots - len(w.running), 0)
        return sorted(keys), free - len(self._unplaced)

    def kick(self) -> None:
        """A slot may have freed or a worker joined: place waiting jobs, claim more.

        A claimed job that no worker here serves any more (it left) goes back to Redis.
        """
        served = {key for w in self.registry if w.available for key in w.served}
        for _ in range(len(self._unplaced)):
            claimed = self._unplaced.popleft()
            if (claimed.job.model, claimed.job.endpoint) not in served:
                self._send(GiveBack(claimed, "no worker of this router serves it any more"))
            elif not self._place(claimed):
                self._unplaced.append(claimed)
        self._capacity.set()

    async def run_claims(self) -> None:
        delay = self.queue.renew_interval_s
        while True:
            raise_if_cancelled()
            keys, free = self.claimable()
            if free <= 0 or not keys:
                self._capacity.clear()
                await self._capacity.wait()
                continue
            try:
                claimed = await self.queue.claim(keys, free)
            except REDIS_DOWN as exc:
                self.queue.outage.failed("claim", exc)  # logged once per outage
                await asyncio.sleep(delay)
                continue
            for c in claimed:
                if not self._place(c):
                    self._unplaced.append(c)

    def _place(self, claimed: Claimed) -> bool:
        qjob = claimed.job
        loads = (w.load() for w in self.registry)
        worker_id = pick_worker(loads, qjob.model, qjob.endpoint)
        worker = self.registry.get(worker_id) if worker_id else None
        if worker is None:
            return False
        job = Job(id=qjob.id, model=qjob.model, endpoint=qjob.endpoint, stream=qjob.stream, body={})
        job.worker_id = worker.id
        job.transition(JobState.ASSIGNED)
        worker.running[job.id] = job
        worker.last_assigned = job.created
        self._held[job.id] = Held(claimed, job, worker)
        body = dict(qjob.body)
        worker.send(
            JobStart(
                job_id=qjob.id,
                model=qjob.model,
                endpoint=qjob.endpoint,
                stream=qjob.stream,
                body=body,
                attempt=claimed.attempt,
            )
        )
        log.info(
            "job %s model=%s (attempt %d) -> worker %s (%d/%d slots)",
            qjob.id,
            qjob.model,
            claimed.attempt,
            worker.id,
            len(worker.running),
            worker.slots,
        )
        return True

    def _release(self, job_id: JobId) -> Held | None:
        held = self._held.pop(job_id, None)
        if held is not None:
            held.worker.running.pop(job_id, None)
            self.kick()
        return held

    # ------------------------------------------------------------ reattaching workers

    def reattach(self, worker: WorkerConnection, jobs: Sequence[RunningJob]) -> None:
        """``worker`` reconnected still running ``jobs`` of a router it lost: adopt them.

        Their slots count as busy at once (stand-ins), so nothing new lands on them first.
        """
        model = worker.models[0].name if worker.models else ModelName("?")
        for running in jobs:
            stand_in = Job(running.job_id, model, Endpoint.CHAT, stream=False, body={})
            worker.running[running.job_id] = stand_in
        self._adoptions.put_nowait((worker, tuple(jobs)))

    async def run_adoptions(self) -> None:
        while True:
            worker, jobs = await self._adoptions.get()
            for running in jobs:
                try:
                    claimed = await self.queue.adopt(running.job_id, running.attempt)
                except REDIS_DOWN as exc:
                    log.warning(
                        "job %s: cannot adopt it, Redis unreachable: %s", running.job_id, exc
                    )
                    claimed = None
                raise_if_cancelled()
                self._adopted(worker, running, claimed)
            self.kick()

    def _adopted(
        self, worker: WorkerConnection, running: RunningJob, claimed: Claimed | None
    ) -> None:
        worker.running.pop(running.job_id, None)
        if claimed is None:
            log.info(
                "job %s: worker %s still runs it, but it ended or runs elsewhere: cancelled",
                running.job_id,
                worker.id,
            )
            worker.send(JobCancel(job_id=running.job_id))
            return
        if self.registry.get(worker.id) is not worker:
            # Lost again meanwhile: not renewed here, the sweep ends it after the lease.
            log.warning("job %s: worker %s left while being adopted", running.job_id, worker.id)
            return
        qjob = claimed.job
        job = Job(id=qjob.id, model=qjob.model, endpoint=qjob.endpoint, stream=qjob.stream, body={})
        job.worker_id = worker.id
        job.transition(JobState.ASSIGNED)
        worker.running[job.id] = job
        self._held[job.id] = Held(claimed, job, worker, started=claimed.seq > 0)
        worker.send(JobResume(job_id=job.id, from_chunk=claimed.seq))
        log.info(
            "job %s model=%s adopted: worker %s resumes it from chunk %d",
            job.id,
            job.model,
            worker.id,
            claimed.seq,
        )

    # ------------------------------------------------------------ worker frames

    def on_chunk(self, worker: WorkerConnection, job_id: JobId, data: str) -> None:
        held = self._held.get(job_id)
        if held is None or held.worker is not worker:
            return  # cancelled or taken over while the chunk was in flight
        held.started = True
        self._send((held.claimed, events.Data(data)))

    def on_end(self, worker: WorkerConnection, job_id: JobId, event: events.OutputEvent) -> None:
        """A final answer (Done, Result) from the worker."""
        held = self._held.get(job_id)
        if held is None or held.worker is not worker:
            return
        self._release(job_id)
        self._send((held.claimed, event))

    def on_failed(self, worker: WorkerConnection, msg: JobFailed) -> None:
        held = self._held.get(msg.job_id)
        if held is None or held.worker is not worker:
            return
        self._release(msg.job_id)
        if msg.retryable and self._may_run_again(held):
            self._send(GiveBack(held.claimed, f"worker {worker.id}: {msg.error.message}"))
        else:
            self._send((held.claimed, events.Failed(msg.status, msg.error)))

    def on_lost(self, worker: WorkerConnection, why: str) -> None:
        """Put back what the lost worker had not answered; fail the rest with a 502."""
        for held in [h for h in self._held.values() if h.worker is worker]:
            self._release(held.claimed.job.id)
            if self._may_run_again(held):
                self._send(GiveBack(held.claimed, f"worker {worker.id} lost: {why}"))
            else:
                self._send((held.claimed, _lost(why)))
        self.kick()

    def _may_run_again(self, held: Held) -> bool:
        return not held.started and held.claimed.attempt <= self.max_requeues

    def _send(self, item: Outgoing) -> None:
        self.loops.send(item)

    # ------------------------------------------------------------ Redis side

    def held_claims(self) -> list[Claimed]:
        """Every job claimed here: running on a worker, or waiting for one."""
        return [h.claimed for h in self._held.values()] + list(self._unplaced)

    def stop_job(self, job_id: JobId) -> Claimed | None:
        """Stop a job here (cancelled, taken over): tell its worker, free its slot."""
        held = self._release(job_id)
        if held is not None:
            held.worker.send(JobCancel(job_id=job_id))
            log.info("job %s stopped on worker %s", job_id, held.worker.id)
            return held.claimed
        for claimed in list(self._unplaced):
            if claimed.job.id == job_id:
                self._unplaced.remove(claimed)
                return claimed
        return None


def _lost(why: str) -> events.Failed:
    return events.Failed(
        502,
        ErrorBody(
            message=f"The worker serving this request was lost ({why}); "
            "the answer is incomplete. Retry the request.",
            type="server_error",
            code="worker_lost",
        ),
    )
