"""The Redis queue's consumer inside a router: its WebSocket workers run jobs from Redis.

One claim loop takes as many jobs as this router's workers have free slots, for every
(model, endpoint) they serve (a blocking ``RedisJobQueue.claim``, in fair order by start
tag; when no slot is free it waits for
one to free or a worker to join, without polling). Each job runs on this router's workers
through ``Running``, as in-process; the job's output stream says which worker (``Assigned``
with the worker's id, for the ``x-shoal-worker`` header of whichever router the client
called), then the worker's frames become output events, published in one round trip per
batch (whatever arrived while the previous publish was in flight). Leases are renewed every
``renew_interval_s``; cancellations from any router reach the worker as ``JobCancel``. Those
loops (publishing, renewals, cancellations, sweeps) are
``redis_queue.consumer.ConsumerLoops``, the same a pull-mode worker runs; this class says
what it holds and how to stop a job.

A job whose run failed, or whose worker was lost, goes back to its queue to run again or to
go on from what its client has (another worker anywhere takes it), or fails, as
``queue.failure.after_failure`` says (``Running`` applies it, as a pull worker does). A job
whose prompt a worker's llama-server refused as too long goes back needing more context:
only a claimer with a slot that holds it takes it (the claim's ``limits``, one per pair
served: ``scheduler.claim_limit``). A
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
from collections.abc import Callable, Sequence

from shoal.jobs.answer import AnswerSoFar, trail_of
from shoal.jobs.events import Assigned, OutputEvent
from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import Continuation, Endpoint, JobCancel, JobResume, RunningJob
from shoal.redis_queue.claimed import Claimed
from shoal.redis_queue.consumer import ConsumerLoops, GiveBack
from shoal.redis_queue.streams import RedisJobQueue
from shoal.redis_queue.support import REDIS_DOWN, raise_if_cancelled
from shoal.router.dispatch.job import Job
from shoal.router.dispatch.running import Running
from shoal.router.dispatch.scheduler import claim_limit
from shoal.router.dispatch.workers import Registry, WorkerConnection
from shoal.router.observe.metrics import Metrics

log = logging.getLogger(__name__)


class Holder:
    """Claims jobs for this router's workers and relays their output to Redis."""

    def __init__(
        self,
        queue: RedisJobQueue,
        registry: Registry,
        metrics: Metrics,
        max_requeues: int,
        resume_attempts: int,
        *,
        prefix: bool = True,
        busier: Callable[[], None] = lambda: None,
    ) -> None:
        """``prefix``: place jobs by the prefixes workers hold (``--routing prefix``);
        ``busier``: a job was placed on a worker here (tell the other routers soon)."""
        self.queue = queue
        self._busier = busier
        self.registry = registry
        self.metrics = metrics
        self.running: Running[Claimed] = Running(
            registry, self, max_requeues, self.kick, resume_attempts, prefix=prefix
        )
        self._unplaced: deque[Claimed] = deque()  # claimed, no free worker for it yet
        self._capacity = asyncio.Event()
        self.loops = ConsumerLoops(queue, self)
        self._adoptions: asyncio.Queue[tuple[WorkerConnection, tuple[RunningJob, ...]]]
        self._adoptions = asyncio.Queue()

    # ------------------------------------------------------------ claiming

    def claimable(
        self,
    ) -> tuple[list[tuple[ModelName, Endpoint]], int, dict[tuple[ModelName, Endpoint], int]]:
        """The pairs this router's workers serve, how many more jobs they can take, and the
        most context a job of each pair may need (``scheduler.claim_limit``)."""
        keys: set[tuple[ModelName, Endpoint]] = set()
        free = 0
        for w in self.registry:
            if w.available:
                keys |= w.served
                free += w.load().free_slots()
        limits = {
            key: claim_limit((w.load() for w in self.registry.serving(*key)), *key) for key in keys
        }
        return sorted(keys), free - len(self._unplaced), limits

    def kick(self) -> None:
        """A slot may have freed or a worker joined: place waiting jobs, claim more.

        A claimed job that no worker here serves any more (it left), or none with the
        context it needs, goes back to Redis. Only the workers serving a waiting job's model
        are looked at (a worker joining, with nothing waiting here, costs nothing).
        """
        for _ in range(len(self._unplaced)):
            claimed = self._unplaced.popleft()
            job = claimed.job
            serving = self.registry.serving(job.model, job.endpoint)
            loads = [w.load() for w in serving if w.available]
            if not loads:
                self.loops.send(GiveBack(claimed, "no worker of this router serves it any more"))
            elif not any(w.fits(job.model, job.need) for w in loads):
                self.loops.send(GiveBack(claimed, "no worker of this router has its context"))
            elif not self._place(claimed):
                self._unplaced.append(claimed)
        self._capacity.set()

    async def run_claims(self) -> None:
        delay = self.queue.renew_interval_s
        while True:
            raise_if_cancelled()
            keys, free, limits = self.claimable()
            if free <= 0 or not keys:
                self._capacity.clear()
                await self._capacity.wait()
                continue
            try:
                claimed = await self.queue.claim(keys, free, limits=limits)
            except REDIS_DOWN as exc:
                self.queue.outage.failed("claim", exc)  # logged once per outage
                await asyncio.sleep(delay)
                continue
            for c in claimed:
                if not self._place(c):
                    self._unplaced.append(c)

    def _place(self, claimed: Claimed) -> bool:
        """Start the job on a worker here, and say which (before any of its output)."""
        qjob = claimed.job
        job = Job(id=qjob.id, model=qjob.model, endpoint=qjob.endpoint, stream=qjob.stream, body={})
        job.resumes = claimed.resumes
        job.need = qjob.need
        if not self.running.place(claimed, job, dict(qjob.body), claimed.attempt, claimed.resume):
            return False
        self.loops.send((claimed, Assigned(self.queue.consumer, claimed.attempt, job.worker_id)))
        self._busier()
        return True

    # ------------------------------------------------------------ reattaching workers

    def reattach(self, worker: WorkerConnection, jobs: Sequence[RunningJob]) -> None:
        """``worker`` reconnected still running ``jobs`` of a router it lost: adopt them.

        Their slots count as busy at once (stand-ins), so nothing new lands on them first.
        """
        model = worker.models[0].name if worker.models else ModelName("?")
        for running in jobs:
            stand_in = Job(running.job_id, model, Endpoint.CHAT, stream=False, body={})
            worker.hold(running.job_id, stand_in)
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
        job.resumes = claimed.resumes
        self.running.adopt(
            claimed, job, worker, claimed.attempt, started=claimed.seq > 0, answer=claimed.answer
        )
        worker.send(JobResume(job_id=job.id, from_chunk=claimed.seq))
        log.info(
            "job %s model=%s adopted: worker %s resumes it from chunk %d",
            job.id,
            job.model,
            worker.id,
            claimed.seq,
        )

    # ------------------------------------------------------------ Sink: what the jobs report

    def output(self, ticket: Claimed, event: OutputEvent, now: float) -> None:
        self.loops.send((ticket, event))

    def run_again(self, ticket: Claimed, why: str) -> None:
        self.loops.send(GiveBack(ticket, why))

    def wait_for_context(self, ticket: Claimed, need: int, why: str) -> None:
        """Back to Redis needing ``need`` tokens of context: only a claimer with a slot that
        holds them takes it; the client's router answers the 400 if none has one."""
        self.loops.send(GiveBack(ticket, why, need=need))

    def trail(self, ticket: Claimed, tokens: tuple[int, ...] | None, answer: AnswerSoFar) -> None:
        if tokens is None and not answer.tokens:
            return  # nothing known of its tokens (an attached backend, an image): no trail
        self.loops.send((ticket, trail_of(tokens, answer)))

    def go_on(self, ticket: Claimed, resume: Continuation, why: str, reason: str) -> bool:
        """Back to Redis with what the client has: any router's worker goes on with it (the
        client's router bounds the wait by ``--max-wait``)."""
        self.metrics.job_resumed(ticket.job.model, reason)
        self.loops.send(GiveBack(ticket, why, resume))
        return True

    # ------------------------------------------------------------ Redis side

    def held_claims(self) -> list[Claimed]:
        """Every job claimed here: running on a worker, or waiting for one."""
        return [p.ticket for p in self.running] + list(self._unplaced)

    def stop_job(self, job_id: JobId) -> Claimed | None:
        """Stop a job here (cancelled, taken over): tell its worker, free its slot."""
        placed = self.running.stop(job_id)
        if placed is not None:
            return placed.ticket
        for claimed in list(self._unplaced):
            if claimed.job.id == job_id:
                self._unplaced.remove(claimed)
                return claimed
        return None
