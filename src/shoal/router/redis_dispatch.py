"""The dispatcher for routers sharing one Redis (``--redis-url``): same interface, jobs in Redis.

Client side: ``submit`` makes the local ``Job`` the relay reads (as in-process), and a
follower task owned by ``run()`` enqueues it in Redis and feeds its events from the output
tail: ``Assigned`` marks it assigned, ``Requeued`` sends it back to waiting, and output
events are delivered. ``wait_assigned`` raises the enqueue's error (429 when the queue is
full) and keeps the ``--max-wait`` rule (withdrawing the job from Redis). ``cancel`` cancels
it in Redis wherever it runs.

Holder side: ``redis_holder.Holder`` runs jobs from Redis on this router's workers; the
worker frames arrive here (``on_chunks``, ``on_message``) as they do in-process.

Shared view: ``worker_directory.WorkerDirectory`` keeps this router's workers in Redis and
reads the others', so any router accepts a request for a model a worker anywhere serves
(and ``/health``, ``/v1/models`` count every router's workers). ``queue_depths`` is the
jobs waiting in Redis for each model, whichever router they were sent to, from a snapshot
``run_depths`` takes every heartbeat interval in one script call (``/v1/models``
``queued`` and the ``shoal_queue_depth`` gauge read it, without a Redis round trip).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import socket
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from shoal.protocol.ids import JobId, ModelName, new_job_id
from shoal.protocol.messages import (
    BackendState,
    Chunks,
    Endpoint,
    ErrorBody,
    Heartbeat,
    JobDone,
    JobFailed,
    JobResult,
    ModelsChanged,
    Register,
    RunningJob,
    StateChanged,
    WorkerMessage,
)
from shoal.queue import events
from shoal.queue.redis_streams import RedisJobQueue
from shoal.queue.redis_support import (
    REDIS_DOWN,
    JobGone,
    OutageLog,
    QueuedJob,
    raise_if_cancelled,
)
from shoal.queue.redis_support import QueueFull as RedisQueueFull
from shoal.queue.redis_tail import OutputTail
from shoal.router.dispatch import (
    RETRY_AFTER_NO_WORKER_S,
    RETRY_AFTER_QUEUE_FULL_S,
    Dispatcher,
    unsupported_endpoint,
)
from shoal.router.errors import QueueFull, RouterError, Unavailable
from shoal.router.jobs import Data, Done, Failed, Job, JobState, Requeued, Result
from shoal.router.metrics import Metrics
from shoal.router.redis_holder import Holder
from shoal.router.settings import RouterSettings
from shoal.router.worker_directory import RemoteWorker, WorkerDirectory
from shoal.router.workers import Registry, WorkerConnection

log = logging.getLogger(__name__)

MIN_LEASE_MS = 3_000


def consumer_name() -> str:
    """This router process's name in the consumer group: host, pid and a random part."""
    host = re.sub(r"[^A-Za-z0-9_.\-]", "-", socket.gethostname())[:60] or "host"
    return f"router-{host}-{os.getpid()}-{secrets.token_hex(4)}"


def lease_ms(settings: RouterSettings) -> int:
    """How long a job's holder may stay silent before another router takes the job over:
    ``--queue-lease``, else twice the worker heartbeat timeout."""
    if settings.queue_lease is not None:
        return max(int(settings.queue_lease * 1000), MIN_LEASE_MS)
    return max(int(settings.heartbeat_timeout * 2000), MIN_LEASE_MS)


@dataclass(eq=False)
class _Followed:
    job: Job
    enqueued: asyncio.Future[None]
    task: asyncio.Task[None] | None = None
    done: bool = field(default=False)


class RedisDispatcher(Dispatcher):
    """``Dispatcher`` whose queue is in Redis, shared by every router on it."""

    queue_backend = "redis"

    def __init__(
        self,
        settings: RouterSettings,
        registry: Registry,
        redis: aioredis.Redis,
        metrics: Metrics | None = None,
        *,
        name: str | None = None,
    ) -> None:
        super().__init__(settings, registry, metrics)
        self.name = name or consumer_name()
        self.outage = OutageLog()  # one log line as Redis goes, one as it is back
        self.rqueue = RedisJobQueue(
            redis,
            settings.redis_prefix,
            self.name,
            max_len=settings.max_queue,
            lease_ms=lease_ms(settings),
            outage=self.outage,
        )
        self.tail = OutputTail(redis, settings.redis_prefix, self.name, outage=self.outage)
        self.holder = Holder(self.rqueue, registry, settings.max_requeues)
        self.directory = WorkerDirectory(
            redis,
            settings.redis_prefix,
            self.name,
            registry,
            interval_s=settings.heartbeat_interval,
            outage=self.outage,
        )
        self._redis = redis
        self._followed: dict[JobId, _Followed] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._depths: dict[ModelName, int] = {}

    async def close(self) -> None:
        """Close the Redis client (after ``run()`` ended)."""
        await self._redis.aclose()

    async def run(self) -> None:
        """Run the tail, the holder's loops and the directory until cancelled."""
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            try:
                tg.create_task(self.tail.run())
                tg.create_task(self.directory.run())
                tg.create_task(self.holder.run_claims())
                loops = self.holder.loops
                for loop in (
                    loops.run_publisher,
                    loops.run_renewals,
                    loops.run_cancellations,
                    loops.run_sweeps,
                ):
                    tg.create_task(loop())
                tg.create_task(self.holder.run_adoptions())
                tg.create_task(self.run_depths())
                await asyncio.Event().wait()
            finally:
                self._tg = None

    # ------------------------------------------------------------ shared view

    def remote_workers(self) -> list[RemoteWorker]:
        return list(self.directory.remote)

    def worker_summaries(self) -> list[dict[str, object]]:
        local: list[dict[str, object]] = [
            {**w.summary(), "router": self.name} for w in self.registry
        ]
        return local + [r.summary for r in self.directory.remote]

    def queue_depths(self) -> Mapping[ModelName, int]:
        """Jobs waiting in Redis per model, sent to any router: the snapshot ``run_depths``
        took, so up to one heartbeat interval old (and, while Redis is unreachable, the
        last one taken before it went)."""
        return self._depths

    async def run_depths(self) -> None:
        """Count the jobs waiting in every queue every heartbeat interval (one script call)."""
        while True:
            try:
                waiting = await self.rqueue.waiting()
            except REDIS_DOWN:
                pass  # the outage is logged by the call; the last snapshot stays
            else:
                depths: Counter[ModelName] = Counter()
                for (model, _), n in waiting.items():
                    depths[model] += n
                self._depths = dict(depths)
            raise_if_cancelled()
            await asyncio.sleep(self.settings.heartbeat_interval)

    # ------------------------------------------------------------ client side

    def submit(
        self, model: ModelName, endpoint: Endpoint, stream: bool, body: dict[str, Any]
    ) -> Job:
        if self._tg is None:
            raise Unavailable("The router is starting or stopping; retry in a moment.")
        self._check_served_anywhere(model, endpoint)
        job = Job(id=new_job_id(), model=model, endpoint=endpoint, stream=stream, body=body)
        followed = _Followed(job, asyncio.get_running_loop().create_future())
        self._followed[job.id] = followed
        followed.task = self._tg.create_task(self._follow(followed))
        return job

    def _check_served_anywhere(self, model: ModelName, endpoint: Endpoint) -> None:
        remote = [r for r in self.directory.remote if r.serves(model)]
        if not remote:
            self._check_served(model, endpoint)  # the in-process answers, with their hints
            return
        if any(r.serves(model, endpoint) for r in remote):
            return
        if any(endpoint in info.endpoints for _, info in self.registry.model_info(model)):
            return
        raise unsupported_endpoint(model, endpoint)

    async def _follow(self, followed: _Followed) -> None:
        job = followed.job
        try:
            if not await self._enqueue(followed):
                return
            async for delivered in self.tail.events(job.id):
                self._on_event(job, delivered.event)
        except (JobGone, events.BadEvent) as exc:
            self._end(job, Failed(502, _error(str(exc), "job_gone")), JobState.FAILED)
        except REDIS_DOWN as exc:
            message = f"The router lost its connection to Redis ({exc}); retry the request."
            self._end(job, Failed(503, _error(message, "redis_unavailable")), JobState.FAILED)
        finally:
            followed.done = True
            if job.state.finished:  # else wait_assigned still has to see the refusal
                self._followed.pop(job.id, None)
            if not followed.enqueued.done():
                _refuse(
                    followed.enqueued, Unavailable("The router is stopping; retry the request.")
                )

    async def _enqueue(self, followed: _Followed) -> bool:
        """Queue the job in Redis; False (the error kept for ``wait_assigned``) if refused."""
        job = followed.job
        queued = QueuedJob(job.id, job.model, job.endpoint, job.stream, job.body)
        try:
            await self.rqueue.enqueue(queued)
        except RedisQueueFull as exc:
            _refuse(followed.enqueued, QueueFull(str(exc), retry_after=RETRY_AFTER_QUEUE_FULL_S))
            return False
        except REDIS_DOWN as exc:
            _refuse(
                followed.enqueued,
                Unavailable(
                    f"The job queue (Redis) is unreachable: {exc}. Retry later.",
                    retry_after=RETRY_AFTER_NO_WORKER_S,
                ),
            )
            return False
        followed.enqueued.set_result(None)
        log.info("job %s model=%s queued in Redis", job.id, job.model)
        return True

    def _on_event(self, job: Job, event: events.JobEvent) -> None:
        if job.state.finished:
            return
        match event:
            case events.Assigned(consumer=consumer, attempt=attempt):
                if job.state is JobState.QUEUED:
                    job.worker_id = None
                    job.transition(JobState.ASSIGNED, f"{consumer} (attempt {attempt})")
                    self.metrics.queue_wait(job.model, time.monotonic() - job.queued_at)
            case events.Requeued(reason=reason):
                if job.state is JobState.ASSIGNED:
                    job.requeues += 1
                    job.transition(JobState.QUEUED, reason)
                    job.deliver(Requeued(reason))
            case events.Data(data=data):
                self._on_data(job, data)
            case events.Result(body=body):
                self._end(job, Result(body), JobState.SUCCEEDED)
            case events.Done():
                self._end(job, Done(), JobState.SUCCEEDED)
            case events.Failed(status=status, error=error):
                self._end(job, Failed(status, error), JobState.FAILED)

    def _on_data(self, job: Job, data: str) -> None:
        now = time.monotonic()
        if job.state is JobState.QUEUED:
            job.transition(JobState.ASSIGNED, "output arrived")
        if job.state is JobState.ASSIGNED:
            job.transition(JobState.STREAMING)
            self.metrics.first_token(job.model, now - job.created)
        else:
            self.metrics.inter_token(job.model, now - job.last_chunk_at)
        job.last_chunk_at = now
        job.deliver(Data(data))

    def _end(self, job: Job, event: Result | Done | Failed, state: JobState) -> None:
        if job.state.finished:
            return
        if job.state is JobState.QUEUED:
            job.transition(JobState.ASSIGNED, "answered")
        job.transition(state)
        job.deliver(event)

    async def wait_assigned(self, job: Job) -> None:
        followed = self._followed.get(job.id)
        if followed is not None:
            try:
                await asyncio.shield(followed.enqueued)
            except RouterError:
                self._followed.pop(job.id, None)
                if job.state is JobState.QUEUED:
                    job.transition(JobState.FAILED, "not queued")
                raise
        remaining = self.settings.max_wait - (time.monotonic() - job.queued_at)
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                await job.assigned.wait()
        except TimeoutError:
            if job.state is not JobState.QUEUED:
                raise
            if not await self.rqueue.withdraw(job.id):
                await job.assigned.wait()  # a holder took it as the limit passed
                return
            self._stop_following(job.id)
            job.transition(JobState.FAILED, "wait limit passed")
            raise Unavailable(
                self._no_worker_message(job), retry_after=RETRY_AFTER_NO_WORKER_S
            ) from None

    def _no_worker_message(self, job: Job) -> str:
        states = sorted(
            {w.backend_state.value for w, _ in self.registry.model_info(job.model)}
            | {r.state.value for r in self.directory.remote if r.serves(job.model)}
        )
        return (
            f"No worker could take this request for model {job.model!r} within "
            f"{self.settings.max_wait:g} s (worker states: {', '.join(states) or 'none'}). "
            "Retry later or add workers."
        )

    def cancel(self, job: Job, why: str) -> None:
        if job.state.finished:
            self._stop_following(job.id)
            return
        self._stop_following(job.id)
        job.transition(JobState.CANCELLED, why)
        log.info("job %s model=%s cancelled: %s", job.id, job.model, why)
        if self._tg is not None:
            self._tg.create_task(self._cancel_in_redis(job.id))

    async def _cancel_in_redis(self, job_id: JobId) -> None:
        try:
            await self.rqueue.cancel(job_id)
        except REDIS_DOWN as exc:
            log.warning("job %s: could not cancel in Redis (%s); it runs to its end", job_id, exc)

    def _stop_following(self, job_id: JobId) -> None:
        followed = self._followed.pop(job_id, None)
        if followed is not None and followed.task is not None and not followed.done:
            followed.task.cancel()

    # ------------------------------------------------------------ worker side

    def on_registered(self, worker: WorkerConnection, held: Sequence[RunningJob] = ()) -> None:
        self.registry.add(worker)
        self.directory.changed()
        if held:
            self.holder.reattach(worker, held)
        self.holder.kick()

    def on_lost(self, worker: WorkerConnection, why: str) -> None:
        self.registry.remove(worker)
        self.holder.on_lost(worker, why)
        self.directory.changed()

    def on_chunks(self, worker: WorkerConnection, items: list[tuple[JobId, str]]) -> None:
        worker.last_seen = time.monotonic()
        for job_id, data in items:
            self.holder.on_chunk(worker, job_id, data)

    def on_message(self, worker: WorkerConnection, msg: WorkerMessage) -> None:
        worker.last_seen = time.monotonic()
        match msg:
            case Chunks(items=items):
                for item in items:
                    self.holder.on_chunk(worker, item.job_id, item.data)
            case JobDone(job_id=job_id):
                self.holder.on_end(worker, job_id, events.Done())
            case JobResult(job_id=job_id, body=body):
                self.holder.on_end(worker, job_id, events.Result(body))
            case JobFailed():
                self.holder.on_failed(worker, msg)
            case Heartbeat(state=state):
                worker.on_heartbeat(msg)
                self._set_state(worker, state, worker.detail)
            case ModelsChanged(models=models):
                worker.set_models(models)
                self.directory.changed()
                self.holder.kick()
            case StateChanged(state=state, detail=detail):
                self._set_state(worker, state, detail)
            case Register():
                raise ValueError("register sent twice")

    def _set_state(self, worker: WorkerConnection, state: BackendState, detail: str) -> None:
        was_available = worker.available
        changed = state is not worker.backend_state
        worker.set_backend_state(state, detail)
        if changed:
            self.directory.changed()
        if worker.available and not was_available:
            self.holder.kick()

    def pump(self) -> None:
        self.holder.kick()


def _refuse(enqueued: asyncio.Future[None], error: Exception) -> None:
    """Keep ``error`` for ``wait_assigned``; no "never retrieved" log if nobody waits."""
    enqueued.set_exception(error)
    enqueued.exception()  # marks it retrieved; awaiting the future still raises it


def _error(message: str, code: str) -> ErrorBody:
    return ErrorBody(message=message, type="server_error", code=code)
