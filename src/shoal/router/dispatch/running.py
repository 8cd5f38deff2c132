"""Jobs running on this router's workers: placing them, and what their workers report.

Both dispatchers run jobs on the workers connected here the same way; they differ only in
where a job's output goes and where a job waits again (``Sink``): in-process, to the waiting
request and the front of the router's queue; with Redis, to the job's output stream and back
into Redis. The rules live here once:

* a job goes to the worker ``pick_worker`` chooses (``scheduler.py``), and holds one of its
  slots until it ends; with ``prefix`` routing its prefix chain (``protocol/prefix.py``,
  computed here once per placement) is matched against what each worker's slots hold;
* a job that produced no output yet runs again elsewhere when its worker fails it as
  retryable or is lost, at most ``--max-requeues`` times; past that it fails (a lost
  worker: 502 ``worker_lost``);
* a streamed chat or text completion that answered in part goes on elsewhere when its worker
  is lost or its backend died, at most ``--resume-attempts`` times: the next worker is given
  the ids of every token the client has (``Continuation``, learned from ``Chunk.tokens``) and
  continues the same stream; a job whose tokens are not exactly known fails as above;
* a non-streamed one goes on the same way: its worker sends its ids as chunks that are
  progress only (kept here, never sent on: the client gets one whole answer); when it cannot
  go on it runs again, as the client has nothing yet;
* frames from a worker that no longer holds the job (cancelled, taken over) are dropped.

``T`` is the dispatcher's handle on a job (the ``Job`` itself in-process, the Redis claim).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from shoal.protocol.ids import JobId
from shoal.protocol.messages import (
    Continuation,
    Endpoint,
    JobCancel,
    JobDone,
    JobFailed,
    JobResult,
    JobStart,
)
from shoal.protocol.prefix import held_blocks, prefix_chain
from shoal.queue.answer import AnswerSoFar
from shoal.queue.events import Data, OutputEvent, from_worker, worker_lost
from shoal.router.dispatch.job import Job, JobState
from shoal.router.dispatch.scheduler import pick_worker
from shoal.router.workers import Registry, WorkerConnection

log = logging.getLogger(__name__)

PREFIXED = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})
"""The endpoints whose prompt a llama-server slot keeps."""

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

    def go_on(self, ticket: T_contra, resume: Continuation, why: str, reason: str) -> bool:
        """The job answered in part and its worker is gone: put it back to wait, to go on
        from ``resume`` (``reason``: the metric's label). False when it cannot (nobody
        serves its model any more): it fails."""
        ...


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
    ) -> None:
        """``capacity`` is called whenever a slot may have freed; ``prefix``: route by the
        prefixes workers hold (``--routing prefix``), else least loaded."""
        self.registry = registry
        self._prefix = prefix
        self._sink = sink
        self._max_requeues = max_requeues
        self._resume_attempts = resume_attempts
        self._capacity = capacity
        self._placed: dict[JobId, Placed[T]] = {}

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
        worker.running[job.id] = job
        worker.last_assigned = time.monotonic()
        answer = AnswerSoFar() if resume is None else AnswerSoFar.going_on(resume)
        self._placed[job.id] = Placed(ticket, job, worker, attempt, answer)
        worker.send(
            JobStart(
                job_id=job.id,
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
        have said yet that it died)."""
        others = (w.load() for w in self.registry if w.id != job.avoid)
        worker_id = pick_worker(others, job.model, job.endpoint, prefix)
        if worker_id is None and job.avoid is not None:
            everyone = (w.load() for w in self.registry)
            worker_id = pick_worker(everyone, job.model, job.endpoint, prefix)
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
        worker.running[job.id] = job
        if answer is None or not started:
            answer = AnswerSoFar.unknown() if started else AnswerSoFar()
        self._placed[job.id] = Placed(ticket, job, worker, attempt, answer)

    def _held_by(self, worker: WorkerConnection, job_id: JobId) -> Placed[T] | None:
        placed = self._placed.get(job_id)
        if placed is None or placed.worker is not worker:
            return None  # cancelled or taken over while the frame was in flight
        return placed

    def _release(self, job_id: JobId) -> Placed[T] | None:
        placed = self._placed.pop(job_id, None)
        if placed is not None:
            placed.worker.running.pop(job_id, None)
        return placed

    def stop(self, job_id: JobId) -> Placed[T] | None:
        """Stop a job here (cancelled, taken over): tell its worker and free its slot."""
        placed = self._release(job_id)
        if placed is not None:
            placed.worker.send(JobCancel(job_id=job_id))
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
        placed.answer.take(data, tokens)
        if not placed.job.stream:
            return  # progress: the ids so far, to go on from (the answer comes whole)
        self._sink.output(placed.ticket, Data(data), now)
        self._sink.trail(placed.ticket, tokens, placed.answer)

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
        why = f"worker {worker.id}: {msg.error.message}"
        if msg.retryable and self._may_run_again(placed):
            self._sink.run_again(placed.ticket, why)
        elif (msg.retryable or msg.resumable) and self._go_on(placed, why, "backend"):
            pass  # (retryable: a run that was to go on never reached the model: again)
        elif msg.resumable and not placed.job.stream and self._may_run_again(placed):
            self._sink.run_again(placed.ticket, why)  # the client has nothing yet
        else:
            log.warning(
                "job %s model=%s failed on worker %s: %s %s",
                msg.job_id,
                placed.job.model,
                worker.id,
                msg.status,
                msg.error.message,
            )
            self._sink.output(placed.ticket, from_worker(msg), now)
        self._capacity()

    def on_lost(
        self, worker: WorkerConnection, why: str, now: float, reason: str = "connection"
    ) -> None:
        """Put back what the lost worker had not answered, go on elsewhere with what it had
        answered in part; fail the rest with a 502. ``reason``: the resume metric's label."""
        for placed in [p for p in self._placed.values() if p.worker is worker]:
            self._release(placed.job.id)
            if self._go_on(placed, f"worker {worker.id} lost: {why}", reason):
                continue  # (nothing sent yet: no continuation, it may run again below)
            if self._may_run_again(placed):
                self._sink.run_again(placed.ticket, f"worker {worker.id} lost: {why}")
                continue
            log.warning(
                "job %s model=%s failed: worker %s lost mid-answer (%s)",
                placed.job.id,
                placed.job.model,
                worker.id,
                why,
            )
            self._sink.output(placed.ticket, worker_lost(why), now)
        self._capacity()

    def _may_run_again(self, placed: Placed[T]) -> bool:
        """Nothing reached the client (a non-streamed job's progress never does)."""
        fresh = not placed.answer.started or not placed.job.stream
        return fresh and placed.attempt <= self._max_requeues

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
