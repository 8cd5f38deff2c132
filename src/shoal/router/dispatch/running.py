"""Jobs running on this router's workers: placing them, and what their workers report.

Both dispatchers run jobs on the workers connected here the same way; they differ only in
where a job's output goes and where a job waits again (``Sink``): in-process, to the waiting
request and the front of the router's queue; with Redis, to the job's output stream and back
into Redis. The rules live here once:

* a job goes to the worker ``pick_worker`` chooses (``scheduler.py``) among those whose
  context per slot holds the job's need (``need.py``), and holds one of its slots until it
  ends; with ``prefix`` routing its prefix chain (``protocol/prefix.py``, computed here once
  per placement) is matched against what each worker's slots hold;
* a job whose run failed (its worker failed it, or was lost) runs again, goes on from the
  ids of the tokens its client has, waits for a worker with more context, or fails, as
  ``queue.failure.after_failure`` says: the one rule, which a pull worker follows too. Going
  on, the next worker is given those ids (``Continuation``, learned from ``Chunk.tokens``;
  a non-streamed job's worker sends them as chunks that are progress only, kept here and
  never sent on: its client gets one whole answer) and continues the answer; a job whose
  prompt a worker's llama-server refused as too long has its need raised to the tokens
  llama-server counted (the sink's ``wait_for_context``: it waits for a worker with that
  much context, or fails with the 400 when none serving its model has it);
* frames from a worker that no longer holds the job (cancelled, taken over) are dropped;
* with ``--preempt`` (in-process), a waiting interactive job of a tenant below its share takes
  the slot of a running answer of a tenant above it (``preemption.py`` chooses): that answer
  is cancelled at its worker and waits first in its tenant's queue to go on from what its
  client has, as if its worker were lost (the sink's ``go_on``, reason ``preempted``). Its
  next run has its own wire id (``run_id``), so that frames of the cancelled run still on
  their way are dropped even when the same worker runs it again.

``T`` is the dispatcher's handle on a job (the ``Job`` itself in-process, the Redis claim).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Generic, Protocol, TypeVar

from shoal.jobs.answer import AnswerSoFar
from shoal.jobs.events import Data, Failed, Loading, OutputEvent, from_worker, worker_lost
from shoal.jobs.failure import Failure, Next, Sent, after_failure, failure_of
from shoal.protocol.ids import JobId
from shoal.protocol.messages import (
    Continuation,
    Endpoint,
    JobCancel,
    JobDone,
    JobFailed,
    JobLoading,
    JobResult,
    JobStart,
)
from shoal.protocol.prefix import held_blocks, prefix_chain
from shoal.router.dispatch.fair_queue import Priority
from shoal.router.dispatch.job import Job, JobState
from shoal.router.dispatch.preemption import MIN_TOKENS, RunningJob, WaitingJob, choose_victim
from shoal.router.dispatch.scheduler import pick_worker
from shoal.router.dispatch.workers import Registry, WorkerConnection

log = logging.getLogger(__name__)

PREFIXED = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES, Endpoint.MESSAGES})
"""The endpoints whose prompt a llama-server slot keeps."""

PREEMPTED = "preempted"
"""The ``go_on`` reason (and resume metric label) of an answer paused for another job."""

T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)


class Sink(Protocol[T_contra]):
    """Where the jobs running here report to: a dispatcher's own side."""

    def output(self, ticket: T_contra, event: OutputEvent, now: float) -> None:
        """The job's output (``now``: when it arrived, monotonic)."""
        ...

    def run_again(self, ticket: T_contra, why: str) -> None:
        """The job produced nothing and may run again: put it back to wait."""
        ...

    def trail(self, ticket: T_contra, tokens: tuple[int, ...] | None, answer: AnswerSoFar) -> None:
        """A chunk was sent on: keep what the client has where another router can see it
        (with Redis; in-process, ``Running`` keeps it)."""
        ...

    def wait_for_context(self, ticket: T_contra, need: int, why: str) -> None:
        """A worker's llama-server refused the job's prompt as longer than its context (it
        produced nothing): wait for a worker whose slots hold ``need`` tokens (``Job.need``
        is raised to it), or fail with the 400 when no worker serving its model has that
        many (in-process here; with Redis, the client's router, which sees every worker)."""
        ...

    def go_on(self, ticket: T_contra, resume: Continuation, why: str, reason: str) -> bool:
        """The job answered in part and its worker is gone: put it back to wait, to go on
        from ``resume`` (``reason``: the metric's label; ``PREEMPTED``: it was paused for
        another job). False when it cannot (nobody serves its model any more): it fails."""
        ...


def run_id(job: Job) -> JobId:
    """The id a run of ``job`` has on the wire: its own, and after each preemption a new
    one (a late frame of a cancelled run is then never taken for the next run's)."""
    return job.id if not job.preemptions else JobId(f"{job.id}.{job.preemptions}")


@dataclass(eq=False, slots=True)
class Placed(Generic[T]):
    """A job running on one of this router's workers."""

    ticket: T
    job: Job
    """The job in ``worker.running``: slot counting and ``/api/v1/workers``."""
    worker: WorkerConnection
    attempt: int
    answer: AnswerSoFar = field(default_factory=AnswerSoFar)
    """What the client has (once it has anything, the job can no longer run again)."""
    since: float = field(default_factory=time.monotonic)
    took_slot: bool = False
    """It started on the slot of a job paused for it (it is never paused itself)."""


class Running(Generic[T]):
    def __init__(
        self,
        registry: Registry,
        sink: Sink[T],
        max_requeues: int,
        capacity: Callable[[], None],
        resume_attempts: int = 0,
        *,
        prefix: bool = True,
        preempt: bool = False,
    ) -> None:
        """``capacity`` is called whenever a slot may have freed (or an answer became one
        that may be paused, with ``preempt``); ``prefix``: route by the prefixes workers hold
        (``--routing prefix``), else least loaded."""
        self.registry = registry
        self._prefix = prefix
        self._preempt = preempt
        self._sink = sink
        self._max_requeues = max_requeues
        self._resume_attempts = resume_attempts
        self._capacity = capacity
        self._placed: dict[JobId, Placed[T]] = {}  # by run id (``run_id``)
        self._runs: dict[JobId, JobId] = {}  # job id -> its run's id

    def __iter__(self) -> Iterator[Placed[T]]:
        return iter(list(self._placed.values()))

    # ------------------------------------------------------------ placing

    def place(
        self,
        ticket: T,
        job: Job,
        body: dict[str, object],
        attempt: int,
        resume: Continuation | None = None,
    ) -> bool:
        """Start ``job`` on the worker the scheduler picks; False if none has a free slot.
        ``resume``: go on with the answer a lost worker began."""
        prefix = prefix_chain(job.model, body) if self._prefix and job.endpoint in PREFIXED else ()
        worker = self._pick(job, prefix)
        if worker is None:
            return False
        held = held_blocks(prefix, worker.load().cached)
        job.prefix = prefix
        worker.note_prefix(prefix)
        job.worker_id = worker.id
        job.transition(JobState.ASSIGNED, f"worker {worker.id}")
        run = self._runs[job.id] = run_id(job)
        worker.hold(run, job)
        worker.last_assigned = worker.assigned[job.model] = time.monotonic()
        answer = AnswerSoFar() if resume is None else AnswerSoFar.going_on(resume)
        self._placed[run] = Placed(ticket, job, worker, attempt, answer)
        worker.send(
            JobStart(
                job_id=run,
                model=job.model,
                endpoint=job.endpoint,
                stream=job.stream,
                body=body,
                attempt=attempt,
                resume=resume,
            )
        )
        log.info(
            "job %s model=%s (attempt %d%s) -> worker %s (%d/%d slots, %d/%d prefix blocks held)",
            job.id,
            job.model,
            attempt,
            "" if resume is None else f", going on after {len(resume.tokens)} tokens",
            worker.id,
            len(worker.running),
            worker.slots,
            held,
            len(prefix),
        )
        return True

    def _pick(self, job: Job, prefix: tuple[int, ...]) -> WorkerConnection | None:
        """The scheduler's worker for ``job`` (by ``prefix`` held, then load); not the one
        that just failed it mid-answer while another can take it (its llama-server may not
        have said yet that it died). Only the workers serving its model and endpoint are
        looked at (``Registry.serving``): the others are no candidates anyway."""
        serving = self.registry.serving(job.model, job.endpoint)
        now = time.monotonic()
        others = (w.load() for w in serving if w.id != job.avoid)
        worker_id = pick_worker(others, job.model, job.endpoint, prefix, job.need, now)
        if worker_id is None and job.avoid is not None:
            everyone = (w.load() for w in serving)
            worker_id = pick_worker(everyone, job.model, job.endpoint, prefix, job.need, now)
        return self.registry.get(worker_id) if worker_id else None

    def adopt(
        self,
        ticket: T,
        job: Job,
        worker: WorkerConnection,
        attempt: int,
        *,
        started: bool,
        answer: AnswerSoFar | None = None,
    ) -> None:
        """Count ``job``, already running on ``worker`` (a worker that reconnected), as here;
        ``started``: it has output already (it cannot run again); ``answer``: what the
        client has of it, when known (its trail in Redis)."""
        job.worker_id = worker.id
        job.transition(JobState.ASSIGNED, f"adopted on worker {worker.id}")
        worker.hold(job.id, job)
        if answer is None or not started:
            answer = AnswerSoFar.unknown() if started else AnswerSoFar()
        self._runs[job.id] = job.id
        self._placed[job.id] = Placed(ticket, job, worker, attempt, answer)

    def _held_by(self, worker: WorkerConnection, run: JobId) -> Placed[T] | None:
        placed = self._placed.get(run)
        if placed is None or placed.worker is not worker:
            return None  # cancelled, paused or taken over while the frame was in flight
        return placed

    def _release(self, run: JobId) -> Placed[T] | None:
        placed = self._placed.pop(run, None)
        if placed is not None:
            placed.worker.running.pop(run, None)
            self._runs.pop(placed.job.id, None)
        return placed

    def _cancel(self, run: JobId) -> Placed[T] | None:
        """Free a job's slot here and tell its worker to stop it."""
        placed = self._release(run)
        if placed is not None:
            placed.worker.send(JobCancel(job_id=run))
        return placed

    def stop(self, job_id: JobId) -> Placed[T] | None:
        """Stop a job here (cancelled, taken over): tell its worker and free its slot."""
        placed = self._cancel(self._runs.get(job_id, job_id))
        if placed is not None:
            log.info("job %s stopped on worker %s", job_id, placed.worker.id)
            self._capacity()
        return placed

    # ------------------------------------------------------------ what workers report

    def on_chunk(
        self,
        worker: WorkerConnection,
        job_id: JobId,
        data: str,
        tokens: tuple[int, ...] | None,
        now: float,
    ) -> None:
        placed = self._held_by(worker, job_id)
        if placed is None:
            return
        before = len(placed.answer.tokens)
        placed.answer.take(data, tokens)
        if placed.job.stream:
            self._sink.output(placed.ticket, Data(data), now)
            self._sink.trail(placed.ticket, tokens, placed.answer)
        # (not streamed: progress, the ids so far to go on from; the answer comes whole)
        if self._preempt and before < MIN_TOKENS <= len(placed.answer.tokens):
            self._capacity()  # it may be paused now for a job waiting

    def on_loading(self, worker: WorkerConnection, msg: JobLoading, now: float) -> None:
        """The job waits while its worker loads its model: a streamed answer's client is told
        (an SSE comment); a non-streamed one just waits."""
        placed = self._held_by(worker, msg.job_id)
        if placed is None:
            return
        log.info("job %s model=%s: worker %s loads the model", placed.job.id, msg.model, worker.id)
        if placed.job.stream:
            self._sink.output(placed.ticket, Loading(msg.model), now)

    def on_end(self, worker: WorkerConnection, msg: JobDone | JobResult, now: float) -> None:
        placed = self._held_by(worker, msg.job_id)
        if placed is not None:
            self._release(msg.job_id)
            self._sink.output(placed.ticket, from_worker(msg), now)
            self._capacity()

    def on_failed(self, worker: WorkerConnection, msg: JobFailed, now: float) -> None:
        placed = self._held_by(worker, msg.job_id)
        if placed is None:
            return
        self._release(msg.job_id)
        if msg.context_needed is not None:
            placed.job.need = max(placed.job.need, msg.context_needed)
        why = f"worker {worker.id}: {msg.error.message}"
        self._after(placed, failure_of(msg), why, "backend", Failed(msg.status, msg.error), now)
        self._capacity()

    def on_lost(
        self, worker: WorkerConnection, why: str, now: float, reason: str = "connection"
    ) -> None:
        """Put back what the lost worker had not answered, go on elsewhere with what it had
        answered in part; fail the rest with a 502. ``reason``: the resume metric's label."""
        for run, placed in [(r, p) for r, p in self._placed.items() if p.worker is worker]:
            self._release(run)
            lost = f"worker {worker.id} lost: {why}"
            self._after(placed, Failure.LOST, lost, reason, worker_lost(why), now)
        self._capacity()

    def _after(
        self, placed: Placed[T], failure: Failure, why: str, reason: str, failed: Failed, now: float
    ) -> None:
        """Do with a job whose run failed what ``queue.failure.after_failure`` says (the rule
        a pull worker follows too); ``failed``: what its client gets if it fails."""
        job = placed.job
        sent = Sent.of(placed.answer, job.endpoint, job.stream, placed.attempt, job.resumes)
        step = after_failure(failure, sent, self._max_requeues, self._resume_attempts)
        if step is Next.GO_ON:
            if self._go_on(placed, why, reason):
                return
            # the sink cannot (no worker here serves its model now): as if it could not go on
            unresumable = replace(sent, resumable=False)
            step = after_failure(failure, unresumable, self._max_requeues, self._resume_attempts)
        if step is Next.RUN_AGAIN:
            self._sink.run_again(placed.ticket, why)
            return
        if step is Next.WAIT_FOR_CONTEXT:
            log.info(
                "job %s model=%s: worker %s has too little context for its prompt; it needs %d "
                "tokens",
                job.id,
                job.model,
                placed.worker.id,
                job.need,
            )
            self._sink.wait_for_context(placed.ticket, job.need, why)
            return
        log.warning("job %s model=%s failed (%s): %s", job.id, job.model, failure.value, why)
        self._sink.output(placed.ticket, failed, now)

    def _go_on(self, placed: Placed[T], why: str, reason: str) -> bool:
        """Hand an answer begun here to the sink to go on elsewhere, when it may."""
        job = placed.job
        resume = placed.answer.continuation(job.endpoint, job.resumes, self._resume_attempts)
        if resume is None:
            return False
        placed.job.avoid = placed.worker.id
        if not self._sink.go_on(placed.ticket, resume, why, reason):
            return False
        log.warning(
            "job %s model=%s: %s; going on elsewhere after %d tokens (resume %d of %d)",
            placed.job.id,
            placed.job.model,
            why,
            len(resume.tokens),
            placed.job.resumes,
            self._resume_attempts,
        )
        return True

    # ------------------------------------------------------------ preemption

    def preempt(self, job: Job, waiting: Mapping[str, float], place: Callable[[], bool]) -> bool:
        """Pause a running answer for ``job``, which waits with no slot free, when
        ``preemption.choose_victim`` says so (``waiting``: the weight of each tenant waiting
        in ``job``'s queue); ``place`` then starts ``job`` on the slot freed. True when an
        answer was paused (should ``place`` fail, the caller places what waits first on the
        slot freed: none is left idle); False: none was."""
        if not self._preempt:
            return False
        workers = [
            w
            for w in self.registry.serving(job.model, job.endpoint)
            if w.available and w.load().fits(job.model, job.need)
        ]
        running = [
            self._candidate(run, other)
            for worker in workers
            for run, other in worker.running.items()
        ]
        victim = choose_victim(
            running,
            _waiting_job(job),
            waiting,
            sum(w.slots for w in workers),
        )
        if victim is None:
            return False
        assert isinstance(victim.ref, str)
        paused = self._cancel(JobId(victim.ref))
        assert paused is not None
        # (a pause is not a loss: it counts against no --resume-attempts)
        resume = paused.answer.continuation(paused.job.endpoint, resumes=0, resume_attempts=1)
        assert resume is not None  # ``RunningJob.resumable``
        paused.job.preemptions += 1
        log.info(
            "job %s model=%s key=%s preempted on worker %s after %d tokens, for job %s key=%s",
            paused.job.id,
            paused.job.model,
            paused.job.tenant.id,
            paused.worker.id,
            len(resume.tokens),
            job.id,
            job.tenant.id,
        )
        if place() and (run := self._runs.get(job.id)) is not None:
            self._placed[run].took_slot = True
        why = f"paused on worker {paused.worker.id} for job {job.id}"
        if not self._sink.go_on(paused.ticket, resume, why, PREEMPTED):
            self._sink.output(paused.ticket, worker_lost(why), time.monotonic())
        return True

    def _candidate(self, run: JobId, job: Job) -> RunningJob:
        """What preemption needs to know of a job running on a slot here."""
        placed = self._placed.get(run)
        tenant = job.tenant
        interactive = tenant.priority is Priority.INTERACTIVE
        if placed is None:  # not this router's to pause (a job held for another router)
            return RunningJob(run, tenant.id, tenant.weight, interactive, 0, 0.0, False)
        return RunningJob(
            run,
            tenant.id,
            tenant.weight,
            interactive,
            len(placed.answer.tokens),
            placed.since,
            placed.answer.resumable(job.endpoint),
            job.preemptions,
            placed.took_slot,
        )


def _waiting_job(job: Job) -> WaitingJob:
    tenant = job.tenant
    return WaitingJob(tenant.id, tenant.weight, tenant.priority is Priority.INTERACTIVE)
