"""Pairs queued jobs with workers and routes worker messages back to jobs.

Everything here runs on the router's event loop without awaiting, so each method is atomic:
a job cannot be assigned twice and a slot cannot be counted twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from shoal.protocol.ids import JobId, ModelName, new_job_id
from shoal.protocol.messages import (
    BackendState,
    Chunks,
    Endpoint,
    ErrorBody,
    Heartbeat,
    JobCancel,
    JobDone,
    JobFailed,
    JobResult,
    JobStart,
    ModelsChanged,
    Register,
    RunningJob,
    StateChanged,
    WorkerMessage,
)
from shoal.queue.memory import MemoryQueue, QueueFullError
from shoal.router.errors import BadRequest, ModelNotFound, QueueFull, Unavailable
from shoal.router.jobs import Data, Done, Failed, Job, JobState, Requeued, Result
from shoal.router.metrics import Metrics, Snapshot
from shoal.router.scheduler import pick_worker
from shoal.router.settings import RouterSettings
from shoal.router.worker_directory import RemoteWorker
from shoal.router.workers import Registry, WorkerConnection

log = logging.getLogger(__name__)

RETRY_AFTER_QUEUE_FULL_S = 2.0
RETRY_AFTER_NO_WORKER_S = 5.0


def queue_key(job: Job) -> tuple[ModelName, Endpoint]:
    return (job.model, job.endpoint)


def unsupported_endpoint(model: ModelName, endpoint: Endpoint) -> BadRequest:
    """The 400 for a model that is served, but not for this endpoint."""
    flag = " (start a worker with --embedding)" if endpoint is Endpoint.EMBEDDINGS else ""
    return BadRequest(
        f"The model {model!r} is not served for {endpoint.path}{flag}.",
        param="model",
        code="unsupported_endpoint",
    )


class Dispatcher:
    queue_backend: ClassVar[str] = "memory"
    """Where jobs wait: ``memory`` (this router only) or ``redis`` (shared by its routers)."""

    def __init__(
        self, settings: RouterSettings, registry: Registry, metrics: Metrics | None = None
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.metrics = metrics or Metrics(Snapshot)
        # One FIFO per (model, endpoint): a queued embeddings job never holds up chat jobs.
        self.queue: MemoryQueue[Job] = MemoryQueue(settings.max_queue, key=queue_key)
        self._where: dict[JobId, WorkerConnection] = {}
        self.unavailable_reason: Callable[[ModelName], str | None] | None = None
        """Why a model no worker serves now is only temporarily away (a split model being
        redeployed): a 503 with ``Retry-After`` instead of a 404."""

    # ------------------------------------------------------------ cluster view

    def remote_workers(self) -> list[RemoteWorker]:
        """Workers connected to other routers (only routers sharing a Redis have any)."""
        return []

    def worker_summaries(self) -> list[dict[str, object]]:
        """Every worker of the cluster, as ``/api/v1/workers`` lists them."""
        return [w.summary() for w in self.registry]

    def queue_depths(self) -> Mapping[ModelName, int]:
        """Requests waiting for a worker, per model (all its endpoints); a model with none
        may be missing. In-process: this router's queue, exact. ``RedisDispatcher``: every
        router's, from a snapshot a heartbeat interval old at most. Cheap: no I/O."""
        depths: Counter[ModelName] = Counter()
        for key in self.queue.waiting_keys():
            if isinstance(key, tuple):
                depths[key[0]] += self.queue.depth(key)
        return depths

    def queued(self, model: ModelName) -> int:
        """Requests waiting for ``model``, over all its endpoints (see ``queue_depths``)."""
        return self.queue_depths().get(model, 0)

    # ------------------------------------------------------------ client side

    def submit(
        self, model: ModelName, endpoint: Endpoint, stream: bool, body: dict[str, Any]
    ) -> Job:
        self._check_served(model, endpoint)
        job = Job(id=new_job_id(), model=model, endpoint=endpoint, stream=stream, body=body)
        if self.queue.depth(queue_key(job)) == 0 and self._try_assign(job):
            return job
        try:
            self.queue.push(job)
        except QueueFullError:
            raise QueueFull(
                f"Too many requests are waiting for model {model!r} "
                f"({self.settings.max_queue}); retry later or add workers.",
                retry_after=RETRY_AFTER_QUEUE_FULL_S,
            ) from None
        depth = self.queue.depth(queue_key(job))
        log.info("job %s model=%s queued (depth %d)", job.id, model, depth)
        return job

    def _check_served(self, model: ModelName, endpoint: Endpoint) -> None:
        served = self.registry.model_info(model)
        why = self.unavailable_reason(model) if self.unavailable_reason and not served else None
        if why:  # a split model that is starting or degraded
            raise Unavailable(why, retry_after=RETRY_AFTER_NO_WORKER_S)
        if not served:
            available = sorted(self.registry.models())
            hint = (
                f"Available: {', '.join(available)}."
                if available
                else ("No worker is connected yet; start one with `shoal worker`.")
            )
            raise ModelNotFound(
                f"The model {model!r} is not served by any connected worker. {hint}",
                param="model",
            )
        if not any(endpoint in info.endpoints for _, info in served):
            raise unsupported_endpoint(model, endpoint)

    async def wait_assigned(self, job: Job) -> None:
        """Wait until a worker takes the job; past the wait limit, give up with a 503."""
        remaining = self.settings.max_wait - (time.monotonic() - job.queued_at)
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                await job.assigned.wait()
        except TimeoutError:
            if job.state is JobState.QUEUED:
                self.queue.remove(job)
                job.transition(JobState.FAILED, "wait limit passed")
                raise Unavailable(
                    self._no_worker_reason(job), retry_after=RETRY_AFTER_NO_WORKER_S
                ) from None
            raise

    def _no_worker_reason(self, job: Job) -> str:
        states = sorted({w.backend_state.value for w, _ in self.registry.model_info(job.model)})
        return (
            f"No worker could take this request for model {job.model!r} within "
            f"{self.settings.max_wait:g} s (worker states: {', '.join(states) or 'none'}). "
            "Retry later or add workers."
        )

    def cancel(self, job: Job, why: str) -> None:
        """The client went away: drop the job wherever it is and stop its generation."""
        if job.state.finished:
            return
        if job.state is JobState.QUEUED:
            self.queue.remove(job)
        else:
            worker = self._release(job)
            if worker is not None:
                worker.send(JobCancel(job_id=job.id))
        job.transition(JobState.CANCELLED, why)
        log.info("job %s model=%s cancelled: %s", job.id, job.model, why)
        self.pump()

    # ------------------------------------------------------------ assignment

    def _try_assign(self, job: Job) -> bool:
        worker_id = pick_worker((w.load() for w in self.registry), job.model, job.endpoint)
        worker = self.registry.get(worker_id) if worker_id else None
        if worker is None:
            return False
        job.worker_id = worker.id
        job.transition(JobState.ASSIGNED)
        worker.running[job.id] = job
        now = time.monotonic()
        worker.last_assigned = now
        self.metrics.queue_wait(job.model, now - job.queued_at)
        self._where[job.id] = worker
        worker.send(
            JobStart(
                job_id=job.id,
                model=job.model,
                endpoint=job.endpoint,
                stream=job.stream,
                body=job.body,
            )
        )
        log.info(
            "job %s model=%s -> worker %s (%d/%d slots)",
            job.id,
            job.model,
            worker.id,
            len(worker.running),
            worker.slots,
        )
        return True

    def pump(self) -> None:
        """Hand queued jobs to workers with free slots, oldest first per (model, endpoint)."""
        for key in self.queue.waiting_keys():
            while (job := self.queue.peek(key)) is not None and self._try_assign(job):
                self.queue.pop(key)

    def _release(self, job: Job) -> WorkerConnection | None:
        worker = self._where.pop(job.id, None)
        if worker is not None:
            worker.running.pop(job.id, None)
        return worker

    def _finish(self, job: Job, state: JobState, why: str = "") -> None:
        self._release(job)
        job.transition(state, why)
        self.pump()

    # ------------------------------------------------------------ worker side

    def on_registered(self, worker: WorkerConnection, held: Sequence[RunningJob] = ()) -> None:
        """A worker joined. ``held``: jobs it still runs from a connection it lost; the
        in-process queue ended those when that connection dropped, so they are cancelled."""
        self.registry.add(worker)
        for running in held:
            log.info("job %s: worker %s still runs it; cancelled", running.job_id, worker.id)
            worker.send(JobCancel(job_id=running.job_id))
        self.pump()

    def on_chunks(self, worker: WorkerConnection, items: list[tuple[JobId, str]]) -> None:
        """Streamed chunks (the hot path: decoded without a model per chunk)."""
        now = worker.last_seen = time.monotonic()
        for job_id, data in items:
            self._on_chunk(worker, job_id, data, now)

    def on_message(self, worker: WorkerConnection, msg: WorkerMessage) -> None:
        worker.last_seen = time.monotonic()
        match msg:
            case Chunks(items=items):
                for item in items:
                    self._on_chunk(worker, item.job_id, item.data, worker.last_seen)
            case JobDone(job_id=job_id):
                self._succeed(worker, job_id, Done())
            case JobResult(job_id=job_id, body=body):
                self._succeed(worker, job_id, Result(body))
            case JobFailed():
                self._on_failed(worker, msg)
            case Heartbeat(state=state):
                worker.on_heartbeat(msg)
                self._on_state(worker, state, worker.detail)
            case ModelsChanged(models=models):
                worker.set_models(models)
                self.pump()
            case StateChanged(state=state, detail=detail):
                self._on_state(worker, state, detail)
            case Register():
                raise ValueError("register sent twice")

    def _succeed(self, worker: WorkerConnection, job_id: JobId, event: Done | Result) -> None:
        if (job := worker.running.get(job_id)) is not None:
            self._finish(job, JobState.SUCCEEDED)
            job.deliver(event)

    def _on_chunk(self, worker: WorkerConnection, job_id: JobId, data: str, now: float) -> None:
        job = worker.running.get(job_id)
        if job is None:
            return  # cancelled while the chunk was in flight
        if job.endpoint.is_image:  # progress events, not tokens: kept out of the token timings
            if job.state is JobState.ASSIGNED:
                job.transition(JobState.STREAMING)
        elif job.state is JobState.ASSIGNED:
            job.transition(JobState.STREAMING)
            self.metrics.first_token(job.model, now - job.created)
        else:
            self.metrics.inter_token(job.model, now - job.last_chunk_at)
        job.last_chunk_at = now
        job.deliver(Data(data))

    def _on_failed(self, worker: WorkerConnection, msg: JobFailed) -> None:
        job = worker.running.get(msg.job_id)
        if job is None:
            return
        if msg.retryable and self._requeue(job, f"worker {worker.id}: {msg.error.message}"):
            self.pump()
            return
        log.warning(
            "job %s model=%s failed on worker %s: %s %s",
            job.id,
            job.model,
            worker.id,
            msg.status,
            msg.error.message,
        )
        self._finish(job, JobState.FAILED, msg.error.message)
        job.deliver(Failed(msg.status, msg.error))

    def _on_state(self, worker: WorkerConnection, state: BackendState, detail: str) -> None:
        was_available = worker.available
        worker.set_backend_state(state, detail)
        if worker.available and not was_available:
            self.pump()

    def _requeue(self, job: Job, why: str) -> bool:
        """Put a job that produced no output back at the head of its queue, if allowed."""
        if job.state is not JobState.ASSIGNED or job.requeues >= self.settings.max_requeues:
            return False
        self._release(job)
        job.requeues += 1
        job.worker_id = None
        job.transition(JobState.QUEUED, why)
        self.queue.push_front(job)
        job.deliver(Requeued(why))
        log.warning("job %s model=%s re-queued (%d): %s", job.id, job.model, job.requeues, why)
        return True

    def on_lost(self, worker: WorkerConnection, why: str) -> None:
        """A worker's connection ended: re-queue what it had not started, fail the rest."""
        self.registry.remove(worker)
        for job in list(worker.running.values()):
            if not self._requeue(job, f"worker {worker.id} lost: {why}"):
                self._release(job)
                job.transition(JobState.FAILED, f"worker {worker.id} lost")
                job.deliver(
                    Failed(
                        502,
                        ErrorBody(
                            message=f"The worker serving this request was lost ({why}); "
                            "the answer is incomplete. Retry the request.",
                            type="server_error",
                            code="worker_lost",
                        ),
                    )
                )
                log.warning(
                    "job %s model=%s failed: worker %s lost mid-answer (%s)",
                    job.id,
                    job.model,
                    worker.id,
                    why,
                )
        self.pump()
