"""The in-process dispatcher: jobs wait in this router's memory for this router's workers.

Everything here runs on the router's event loop without awaiting, so each method is atomic:
a job cannot be assigned twice and a slot cannot be counted twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping

from shoal.jobs.answer import AnswerSoFar
from shoal.jobs.events import Failed, OutputEvent
from shoal.protocol.ids import ModelName
from shoal.protocol.messages import Continuation, Endpoint
from shoal.router.dispatch import answers, places
from shoal.router.dispatch.answers import UnavailableReason
from shoal.router.dispatch.directory import RemoteWorker
from shoal.router.dispatch.fair_queue import FairQueue, QueueFull, Tenant
from shoal.router.dispatch.heartbeats import HeartbeatPace
from shoal.router.dispatch.job import Job, JobState, Submission
from shoal.router.dispatch.output import JobOutput
from shoal.router.dispatch.running import PREEMPTED, Running
from shoal.router.dispatch.worker_side import WorkerSide
from shoal.router.dispatch.workers import Registry
from shoal.router.observe.metrics import Metrics
from shoal.router.settings import RouterSettings

log = logging.getLogger(__name__)


def queue_key(job: Job) -> tuple[ModelName, Endpoint]:
    return (job.model, job.endpoint)


class MemoryDispatcher:
    def __init__(
        self,
        settings: RouterSettings,
        registry: Registry,
        metrics: Metrics,
        away: UnavailableReason = answers.never_away,
    ) -> None:
        """``away``: why a model nobody serves is only away for a while (``answers``)."""
        self.settings = settings
        self.registry = registry
        self._away = away
        self._output = JobOutput(metrics)
        # One queue per (model, endpoint): a queued embeddings job never holds up chat jobs.
        self._queues: dict[tuple[ModelName, Endpoint], FairQueue[Job]] = {}
        self._moved = asyncio.Event()  # set (and replaced) whenever a queue changes
        self._running: Running[Job] = Running(
            registry,
            self,
            settings.max_requeues,
            self.pump,
            settings.resume_attempts,
            prefix=settings.routing == "prefix",
            preempt=settings.preempt and settings.scheduling == "fair",
        )
        self.queue_backend = "memory"
        pace = HeartbeatPace(settings.heartbeat_interval, settings.heartbeat_rate)
        self.workers = WorkerSide(registry, self._running, self.pump, pace=pace)

    # ------------------------------------------------------------ cluster view

    def queue_depths(self) -> Mapping[ModelName, int]:
        """This router's queue, exact."""
        depths: Counter[ModelName] = Counter()
        for (model, _), queue in self._queues.items():
            depths[model] += len(queue)
        return depths

    def oldest_waits(self) -> Mapping[ModelName, float]:
        """How long each model's oldest waiting job has waited here, now (O(waiting jobs))."""
        now = time.monotonic()
        oldest: dict[ModelName, float] = {}
        for (model, _), queue in self._queues.items():
            for job in queue.jobs():
                oldest[model] = max(oldest.get(model, 0.0), now - job.queued_at)
        return oldest

    def waiting_by_key(self) -> Mapping[str, int]:
        """Requests waiting here per tenant (API key id), over every queue."""
        total: Counter[str] = Counter()
        for queue in self._queues.values():
            total.update(queue.waiting_by_tenant())
        return total

    def _queue(self, job: Job) -> FairQueue[Job]:
        queue = self._queues.get(queue_key(job))
        if queue is None:
            fair = self.settings.scheduling == "fair"
            queue = self._queues[queue_key(job)] = FairQueue(self.settings.max_queue, fair=fair)
        return queue

    def remote_workers(self) -> list[RemoteWorker]:
        return []

    def heard_from_cluster(self) -> float | None:
        return None

    def worker_summaries(self) -> list[dict[str, object]]:
        return [w.summary() for w in self.registry]

    # ------------------------------------------------------------ a request's side

    def check_served(self, model: ModelName, endpoint: Endpoint) -> None:
        answers.check_served(model, endpoint, self.registry, (), self._away)
        answers.check_fits(model, endpoint, self.registry, ())

    def submit(self, ask: Submission) -> Job:
        self.check_served(ask.model, ask.endpoint)
        job = Job.of(ask, answers.context_need(ask, self.registry, ()))
        queue = self._queue(job)
        if not queue and self._try_assign(job):
            queue.charge(job.tenant, job.work)
            return job
        self._check_key_cap(job)
        now = time.monotonic()
        try:
            queue.push(job, job.tenant, job.work, now)
        except QueueFull:
            raise answers.queue_full(job.model, self.settings.max_queue) from None
        self._queue_moved()
        log.info(
            "job %s model=%s key=%s queued (%d ahead, %d waiting)",
            job.id,
            job.model,
            job.tenant.id,
            queue.position(job, now),
            len(queue),
        )
        self.pump()  # with --preempt it may take a slot from a key above its share
        return job

    def _key_waiting(self, tenant: Tenant) -> int:
        """Jobs of ``tenant`` waiting on this router, for every model."""
        return sum(queue.waiting(tenant.id) for queue in self._queues.values())

    def _check_key_cap(self, job: Job) -> None:
        """429 for a job that would wait while its key has ``max_queued`` jobs waiting here
        already (requeued jobs are not checked: they were accepted once)."""
        cap = job.tenant.max_queued
        if cap is None or (waiting := self._key_waiting(job.tenant)) < cap:
            return
        log.info(
            "job %s model=%s key=%s refused: %d of its jobs waiting, its max-queued is %d",
            job.id,
            job.model,
            job.tenant.id,
            waiting,
            cap,
        )
        raise answers.key_queue_full(job.model, cap)

    async def wait_assigned(self, job: Job) -> None:
        await answers.wait_assigned(
            job,
            self.settings.max_wait,
            self._withdraw,
            lambda: answers.no_worker(job, self.settings.max_wait, self.registry, ()),
        )

    async def _withdraw(self, job: Job) -> bool:
        self._queue(job).remove(job)
        self._queue_moved()
        return True

    def queue_positions(self, job: Job) -> AsyncIterator[int] | None:
        return self._positions(job) if job.state is JobState.QUEUED else None

    def _positions(self, job: Job) -> AsyncIterator[int]:
        """The job's place while it waits (``places.report``); past ``--max-wait`` the 503
        of ``wait_assigned``."""

        def place(now: float) -> int | None:
            queue = self._queue(job)
            return queue.position(job, now) if job in queue else None

        deadline = job.queued_at + self.settings.max_wait
        return places.report(
            job, deadline, place, lambda: self._moved, lambda: self.wait_assigned(job)
        )

    def _queue_moved(self) -> None:
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()

    def cancel(self, job: Job, why: str) -> None:
        if job.state.finished:
            return
        if job.state is JobState.QUEUED:
            self._queue(job).remove(job)
            self._queue_moved()
        else:
            self._running.stop(job.id)
        job.transition(JobState.CANCELLED, why)
        log.info("job %s model=%s cancelled: %s", job.id, job.model, why)
        self.pump()

    # ------------------------------------------------------------ assignment

    def _try_assign(self, job: Job) -> bool:
        attempt = job.requeues + job.resumes + 1
        if not self._running.place(job, job, job.body, attempt, job.resume):
            return False
        self._output.metrics.queue_wait(job.model, job.tenant.id, time.monotonic() - job.queued_at)
        return True

    def settle(self, job: Job, tokens: int) -> None:
        self._queue(job).settle(job.tenant, job.work, tokens)

    def pump(self) -> None:
        """Hand queued jobs to workers with free slots, in each queue's order; with
        ``--preempt``, a head that finds none may take a slot from a tenant above its share.
        A head that no free worker has the context for lets the jobs after it that one has
        go first (as a Redis claim passes over it): no worker idles while a job it could
        take waits."""
        now = time.monotonic()
        moved = False
        for key, queue in list(self._queues.items()):
            while (job := queue.peek(now)) is not None and (
                self._place(queue, job) or self._preempt_for(queue, job)
            ):
                moved = True
            if job is not None and self._free_slot(key):
                moved = self._pass_over(queue, now) or moved
        if moved:
            self._queue_moved()

    def _free_slot(self, key: tuple[ModelName, Endpoint]) -> bool:
        return any(w.available and len(w.running) < w.slots for w in self.registry.serving(*key))

    def _pass_over(self, queue: FairQueue[Job], now: float) -> bool:
        """Place the jobs that free workers can take, in the queue's order; True if any."""
        placed = False
        for job in queue.ranked(now):
            if not self._free_slot(queue_key(job)):
                break
            placed = self._place(queue, job) or placed
        return placed

    def _preempt_for(self, queue: FairQueue[Job], job: Job) -> bool:
        return self._running.preempt(job, queue.waiting_weights(), lambda: self._place(queue, job))

    def _place(self, queue: FairQueue[Job], job: Job) -> bool:
        if not self._try_assign(job):
            return False
        queue.pop(job)
        return True

    # ------------------------------------------------------------ Sink: what the jobs report

    def output(self, ticket: Job, event: OutputEvent, now: float) -> None:
        self._output.deliver(ticket, event, now)

    def run_again(self, ticket: Job, why: str) -> None:
        """Back to the head of its queue (it waited its turn already)."""
        self._output.requeued(ticket, why)
        self._queue(ticket).push_front(ticket, ticket.tenant, ticket.work, time.monotonic())
        self._queue_moved()
        log.warning(
            "job %s model=%s re-queued (%d): %s", ticket.id, ticket.model, ticket.requeues, why
        )

    def wait_for_context(self, ticket: Job, need: int, why: str) -> None:
        """Back to the head of its queue for a worker with ``need`` tokens of context per
        slot; the 400 when none here has that many."""
        error = answers.too_long(ticket, need, self.registry, ())
        if error is None:
            self.run_again(ticket, why)
            return
        log.info(
            "job %s model=%s: no worker has %d tokens of context", ticket.id, ticket.model, need
        )
        self.output(ticket, Failed(400, error), time.monotonic())

    def trail(self, ticket: Job, tokens: tuple[int, ...] | None, answer: AnswerSoFar) -> None:
        return  # ``Running`` keeps it: the job ends with this router anyway

    def go_on(self, ticket: Job, resume: Continuation, why: str, reason: str) -> bool:
        """Back to the head of its queue, to go on from ``resume`` on the next worker; not
        when no worker here serves its model any more (its stream ends as it would have)."""
        if not self.registry.serving(ticket.model, ticket.endpoint):
            return False
        ticket.resume = resume
        if reason == PREEMPTED:  # (not a loss: it does not use up --resume-attempts)
            self._output.metrics.job_preempted(ticket.model)
        else:
            ticket.resumes += 1
        self._output.metrics.job_resumed(ticket.model, reason)
        self._output.going_on(ticket, why)
        self._queue(ticket).push_front(ticket, ticket.tenant, ticket.work, time.monotonic())
        self._queue_moved()
        return True

    # ------------------------------------------------------------ lifetime

    async def run(self) -> None:
        return  # nothing runs in the background: everything happens as messages arrive

    async def close(self) -> None:
        return
