"""Runs async jobs in the background, each as a task owned by one task group.

``JobsService.run`` (or the ``running()`` context manager, for a lifespan) owns an
``asyncio.TaskGroup``; ``submit`` stores a queued record and starts the job into that group.
Each job task calls the injected ``Runner`` and records what it returns. ``cancel`` marks the
record cancelled and cancels the job's task, whose runner then cancels the dispatcher job.

The runner contract (``Runner``): given a ``RunRequest``, run the request once, not streamed,
and return ``RunSucceeded(result)`` (the answer's JSON object) or ``RunFailed(status, error)``
(an OpenAI error object); raising a ``RouterError`` counts as ``RunFailed`` with its status.
It should ``await request.started()`` once a worker has taken the job (the record then says
``running``), and must stop its work when cancelled (``finally: dispatcher.cancel(job)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from shoal.api_errors import ApiError, error_payload
from shoal.keys.records import Queueing
from shoal.protocol.messages import Endpoint
from shoal.router.async_jobs.records import (
    AsyncJobId,
    JobRecord,
    JobType,
    new_async_job_id,
    parse_async_job_id,
)
from shoal.router.async_jobs.store.interface import (
    JobAlreadyFinished,
    JobNotFound,
    JobStore,
    JobStoreUnavailable,
    TooManyJobs,
)
from shoal.router.errors import RouterError, Unavailable

log = logging.getLogger(__name__)

MAX_ACTIVE_JOBS = 1024
"""Most async jobs one router runs (queued or running) before POST /v1/jobs answers 429."""
SHUTDOWN_WRITE_S = 1.0
"""On shutdown, how long to try to mark each interrupted job failed in the store."""
RETRY_AFTER_TOO_MANY_S = 5.0
FIRST_NEWS_WAIT_S = 1.0
"""How long ``submit`` waits for a new job's first news (its place in the queue, a worker, or
its end) so that the 202 shows it: at once with the in-process queue; with Redis a place is
known once a job has waited 0.25 s (a free worker anywhere takes it before)."""


@dataclass(frozen=True)
class Owner:
    """Who submits a job: the API key's id (None when the router has no keys of the database)
    and how that key's requests queue (its weight and ``max_queued``; jobs queue as batch)."""

    key_id: str | None
    queueing: Queueing = Queueing()


@dataclass(frozen=True)
class RunRequest:
    """One async job for the runner: run ``body`` against ``endpoint`` for ``model``."""

    job_id: AsyncJobId
    type: JobType
    endpoint: Endpoint
    model: str
    body: dict[str, Any]
    """The checked request body (limits applied), without ``type``; never streamed."""
    key_id: str | None
    """The API key that submitted it (usage and limits are charged to it)."""
    started: Callable[[], Awaitable[None]]
    """Await once a worker has taken the job: the record moves to ``running``."""
    progress: Callable[[dict[str, Any]], Awaitable[None]] | None = None
    """Await with each progress report of a running job (image steps): the record shows it."""
    queued: Callable[[int], Awaitable[None]] | None = None
    """Await with the job's place in the queue while it waits: the record shows it."""
    queueing: Queueing = Queueing()
    """How the key's requests queue: the job waits with its weight and ``max_queued``."""


@dataclass(frozen=True)
class RunSucceeded:
    result: dict[str, Any]


@dataclass(frozen=True)
class RunFailed:
    status: int
    error: dict[str, Any]
    """An OpenAI error object: ``message``, ``type``, ``param``, ``code``."""

    @classmethod
    def of(cls, exc: ApiError) -> RunFailed:
        return cls(exc.status, cast(dict[str, Any], error_payload(exc)["error"]))


RunOutcome = RunSucceeded | RunFailed
Runner = Callable[[RunRequest], Awaitable[RunOutcome]]

_INTERNAL = RouterError("Internal error in the router while running this job; see its log.")
_STOPPED = RouterError(
    "The router stopped before this job finished; submit it again.", code="router_stopped"
)


class JobsService:
    def __init__(
        self,
        store: JobStore,
        runner: Runner,
        *,
        max_active: int = MAX_ACTIVE_JOBS,
        clock: Callable[[], float] = time.time,
        first_news_wait_s: float = FIRST_NEWS_WAIT_S,
    ) -> None:
        self.store = store
        self.runner = runner
        self.max_active = max_active
        self.clock = clock
        self.first_news_wait_s = first_news_wait_s
        self._group: asyncio.TaskGroup | None = None
        self._ready = asyncio.Event()
        self._tasks: dict[AsyncJobId, asyncio.Task[None]] = {}
        self._cancelled: set[AsyncJobId] = set()
        self._creating = 0  # submits between the capacity check and their task's start
        self._idle = asyncio.Event()
        self._idle.set()

    # ------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Own the job tasks and the store's loop until cancelled (then cancel every job)."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self.store.run(self._cancelled_elsewhere))
            self._group = group
            self._ready.set()
            try:
                await asyncio.get_running_loop().create_future()  # until cancelled
            finally:
                self._group = None
                self._ready.clear()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[JobsService]:
        """``run`` for the duration of the block (a lifespan, or a test)."""
        async with asyncio.TaskGroup() as group:
            task = group.create_task(self.run())
            await self._ready.wait()
            try:
                yield self
            finally:
                task.cancel()

    @property
    def active(self) -> int:
        return len(self._tasks)

    async def wait_idle(self) -> None:
        """Return once no job task is left (tests: run until idle, with no sleeps)."""
        await self._idle.wait()

    # ------------------------------------------------------------ API

    async def submit(
        self, job_type: JobType, model: str, body: dict[str, Any], owner: Owner
    ) -> JobRecord:
        """Store a queued job and start running it; 429 past ``max_active``. The record
        returned is the job's once its first news came (``FIRST_NEWS_WAIT_S``): queued with
        its ``queue_position``, running, or ended."""
        if self._group is None:
            raise RuntimeError("JobsService.run() is not running: start it in the lifespan")
        if len(self._tasks) + self._creating >= self.max_active:
            raise TooManyJobs(
                f"This router already runs {self.max_active} async jobs; retry later.",
                retry_after=RETRY_AFTER_TOO_MANY_S,
            )
        record = JobRecord(
            id=new_async_job_id(),
            type=job_type,
            model=model,
            owner=owner.key_id,
            created_at=self.clock(),
        )
        self._creating += 1
        try:
            await self.store.create(record)
        finally:
            self._creating -= 1
        group = self._group
        if group is None:  # the service stopped while the record was being stored
            await self._record_stopped(record.id)
            raise Unavailable("The router is stopping; submit the job again (to another router).")
        news = asyncio.Event()
        request = RunRequest(
            job_id=record.id,
            type=job_type,
            endpoint=job_type.endpoint,
            model=model,
            body=body,
            key_id=owner.key_id,
            started=lambda: self._started(record.id, news),
            progress=lambda report: self.store.set_progress(record.id, report),
            queued=lambda place: self._queued(record.id, place, news),
            queueing=owner.queueing,
        )
        task = group.create_task(self._run_job(request), name=f"async job {record.id}")
        self._tasks[record.id] = task
        self._idle.clear()
        task.add_done_callback(lambda _: news.set())
        task.add_done_callback(lambda _: self._forget(record.id))
        log.info("async job %s model=%s type=%s queued", record.id, model, job_type)
        return await self._after_first_news(record, news)

    async def _after_first_news(self, record: JobRecord, news: asyncio.Event) -> JobRecord:
        """``record`` as it stands once ``news`` came, or ``first_news_wait_s`` passed."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.first_news_wait_s):
                await news.wait()
        try:
            return await self.store.get(record.id) or record
        except JobStoreUnavailable:  # it was stored: the 202 stands, without the news
            return record

    async def get(self, job_id: str, owner: str | None) -> JobRecord:
        """The job's record, if ``owner`` may see it; else ``JobNotFound`` (404)."""
        parsed = parse_async_job_id(job_id)
        record = None if parsed is None else await self.store.get(parsed)
        if record is None or not record.visible_to(owner):
            raise JobNotFound(job_id, self.store.ttl_s)
        return record

    async def cancel(self, job_id: str, owner: str | None) -> JobRecord:
        """Cancel a queued or running job: 404 if unknown, 409 if it has already ended."""
        record = await self.get(job_id, owner)
        outcome = await self.store.cancel(record.id)
        if outcome.record is None:
            raise JobNotFound(job_id, self.store.ttl_s)
        if not outcome.cancelled:
            raise JobAlreadyFinished(outcome.record)
        self._cancel_task(record.id)
        return outcome.record

    # ------------------------------------------------------------ job tasks

    async def _started(self, job_id: AsyncJobId, news: asyncio.Event) -> None:
        await self.store.set_running(job_id)
        news.set()

    async def _queued(self, job_id: AsyncJobId, place: int, news: asyncio.Event) -> None:
        await self.store.set_queue_position(job_id, place)
        news.set()

    async def _run_job(self, request: RunRequest) -> None:
        try:
            outcome = await self._outcome(request)
        except asyncio.CancelledError:
            if request.job_id not in self._cancelled:
                await self._record_stopped(request.job_id)
            raise
        try:
            await self._record(request.job_id, outcome)
        except JobStoreUnavailable:
            log.error("async job %s: could not record its outcome (store down)", request.job_id)

    async def _outcome(self, request: RunRequest) -> RunOutcome:
        try:
            return await self.runner(request)
        except RouterError as exc:
            return RunFailed.of(exc)
        except Exception:  # a job's bug must fail that job, not the task group of all jobs
            log.exception("async job %s model=%s: runner crashed", request.job_id, request.model)
            return RunFailed.of(_INTERNAL)

    async def _record(self, job_id: AsyncJobId, outcome: RunOutcome) -> None:
        if isinstance(outcome, RunSucceeded):
            await self.store.set_running(job_id)  # in case the runner never said so
            ended = await self.store.finish(job_id, result=outcome.result)
        else:
            ended = await self.store.finish(job_id, error=outcome.error)
        if ended is None:
            log.info("async job %s: outcome dropped (cancelled or expired meanwhile)", job_id)
        elif isinstance(outcome, RunFailed):
            log.info(
                "async job %s failed (%d): %s", job_id, outcome.status, outcome.error.get("message")
            )

    async def _record_stopped(self, job_id: AsyncJobId) -> None:
        """The service is stopping: say so in the record, briefly (other routers may read it)."""
        with contextlib.suppress(TimeoutError, JobStoreUnavailable):
            async with asyncio.timeout(SHUTDOWN_WRITE_S):
                await self.store.finish(job_id, error=RunFailed.of(_STOPPED).error)

    def _cancel_task(self, job_id: AsyncJobId) -> None:
        task = self._tasks.get(job_id)
        if task is not None and not task.done() and job_id not in self._cancelled:
            self._cancelled.add(job_id)
            task.cancel()
            log.info("async job %s: cancelling its run", job_id)

    def _cancelled_elsewhere(self, job_id: AsyncJobId) -> None:
        """A router (maybe this one) cancelled ``job_id`` in the shared store."""
        self._cancel_task(job_id)

    def _forget(self, job_id: AsyncJobId) -> None:
        self._tasks.pop(job_id, None)
        self._cancelled.discard(job_id)
        if not self._tasks:
            self._idle.set()
