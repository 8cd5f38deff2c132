"""A job's outcome reaching the request that waits for it: state, timings and delivery.

Both dispatchers end here. In-process, the worker's frames arrive straight from the worker
connection; with Redis, they arrive from the job's output stream (perhaps from a worker of
another router). Either way the job moves through its state machine the same way, the same
first-token and inter-token timings are taken, and the same events reach ``Job.events``.
"""

from __future__ import annotations

import time

from shoal.jobs.events import Data, Failed, Loading, OutputEvent, Requeued
from shoal.router.dispatch.job import Job, JobState
from shoal.router.observe.metrics import Metrics


class JobOutput:
    """Delivers outcome events to the router's ``Job`` objects and times them."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def assigned(self, job: Job, why: str = "") -> None:
        """A worker (here or anywhere) took the job."""
        if job.state is JobState.QUEUED:
            job.transition(JobState.ASSIGNED, why)
            self.metrics.queue_wait(job.model, job.tenant.id, time.monotonic() - job.queued_at)

    def requeued(self, job: Job, why: str) -> None:
        """The job went back to wait (its worker was lost before it answered)."""
        if job.state is JobState.ASSIGNED:
            job.requeues += 1
            job.worker_id = None
            job.transition(JobState.QUEUED, why)
            job.deliver(Requeued(why))

    def going_on(self, job: Job, why: str) -> None:
        """The job's worker was lost mid-answer (or the run that was to go on failed before
        its first token): it waits to go on on another."""
        if job.state in (JobState.STREAMING, JobState.ASSIGNED):
            if job.state is JobState.STREAMING or job.lost_at is None:
                job.lost_at = time.monotonic()
            job.worker_id = None
            job.transition(JobState.QUEUED, f"to go on: {why}")
            job.deliver(Requeued(why))

    def deliver(self, job: Job, event: OutputEvent, now: float) -> None:
        """Output from the job's worker; ``now`` is when it arrived (monotonic)."""
        if job.state.finished:
            return  # cancelled while the output was in flight
        if isinstance(event, Data):
            self._data(job, event, now)
            return
        if isinstance(event, Loading):  # it waits on: no output yet, nothing moves
            job.deliver(event)
            return
        if job.state is JobState.QUEUED:  # its Assigned event was overtaken
            job.transition(JobState.ASSIGNED, "answered")
        job.transition(JobState.FAILED if isinstance(event, Failed) else JobState.SUCCEEDED)
        job.deliver(event)

    def _data(self, job: Job, event: Data, now: float) -> None:
        if job.state is JobState.QUEUED:
            job.transition(JobState.ASSIGNED, "output arrived")
        if job.endpoint.is_image:  # progress events, not tokens: kept out of the token timings
            if job.state is JobState.ASSIGNED:
                job.transition(JobState.STREAMING)
        elif job.state is JobState.ASSIGNED and job.lost_at is not None:
            job.transition(JobState.STREAMING, "going on")
            self.metrics.resumed_output(job.model, now - job.lost_at)
            job.lost_at = None
        elif job.state is JobState.ASSIGNED:
            job.transition(JobState.STREAMING)
            self.metrics.first_token(job.model, now - job.created)
        else:
            self.metrics.inter_token(job.model, now - job.last_chunk_at)
        job.last_chunk_at = now
        job.deliver(event)
