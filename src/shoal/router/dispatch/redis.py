"""The dispatcher for routers sharing one Redis (``--redis-url``): jobs wait in Redis.

Client side: ``submit`` makes the local ``Job`` the relay reads (as in-process), and a
follower task owned by ``run()`` enqueues it in Redis and feeds its events from the output
tail: ``Assigned`` marks it assigned (and, from its consumer, names the worker running it),
``Requeued`` sends it back to waiting, and output events are delivered. ``wait_assigned``
raises the enqueue's error (429 when the queue is full) and keeps the ``--max-wait`` rule
(withdrawing the job from Redis). ``cancel`` cancels it in Redis wherever it runs.

Holder side: ``holder.Holder`` runs jobs from Redis on this router's workers (through
``Running``, as in-process); their frames arrive through ``workers`` as they do in-process.

Shared view: ``directory.WorkerDirectory`` keeps this router's workers in Redis and
reads the others', so any router accepts a request for a model a worker anywhere serves
(and ``/health``, ``/v1/models`` count every router's workers). ``queue_depths`` is the
jobs waiting in Redis for each model, whichever router they were sent to, from a snapshot
``run_depths`` takes every heartbeat interval in one script call (``/v1/models``
``queued`` and the ``shoal_queue_depth`` gauge read it, without a Redis round trip), with
the jobs waiting per API key (``waiting_by_key``: every router's, for the per-key gauge and
the dashboard).

Fair scheduling: each job is enqueued with its key's share (``Share``: the tenant, weight,
class, estimated work, ``--scheduling`` and ``max_queued``), and Redis orders the waiting
jobs by start tag for every router and pull-mode worker (``redis_queue.streams``); a key
over its ``max_queued`` jobs waiting anywhere gets the 429 ``key_queue_full``. ``settle``
corrects the key's finish tag in Redis when a job ends. ``run_positions`` reads the places
of this router's waiting jobs in one script call every ``POSITIONS_INTERVAL_S`` (only while
some wait), for the ``: queued position=N`` comments and ``queue_position`` of async jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from shoal.jobs import events
from shoal.protocol.ids import JobId, ModelName, WorkerId
from shoal.protocol.messages import Endpoint, ErrorBody
from shoal.protocol.prefix import prefix_chain
from shoal.redis_queue.streams import RedisJobQueue
from shoal.redis_queue.support import (
    REDIS_DOWN,
    JobGone,
    KeyQueueFull,
    OutageLog,
    QueuedJob,
    Share,
    raise_if_cancelled,
)
from shoal.redis_queue.support import QueueFull as RedisQueueFull
from shoal.redis_queue.tail import OutputTail
from shoal.router.dispatch import answers, places
from shoal.router.dispatch.answers import UnavailableReason
from shoal.router.dispatch.directory import RemoteWorker, WorkerDirectory
from shoal.router.dispatch.fair_queue import Priority
from shoal.router.dispatch.heartbeats import HeartbeatPace
from shoal.router.dispatch.holder import Holder
from shoal.router.dispatch.job import Job, JobState, Submission
from shoal.router.dispatch.output import JobOutput
from shoal.router.dispatch.running import PREFIXED
from shoal.router.dispatch.worker_side import WorkerSide
from shoal.router.dispatch.workers import Registry
from shoal.router.errors import QueueFull, RouterError, Unavailable
from shoal.router.observe.metrics import Metrics
from shoal.router.settings import RouterSettings

log = logging.getLogger(__name__)

MIN_LEASE_MS = 3_000
POSITIONS_INTERVAL_S = 0.5
"""How often the places of this router's waiting jobs are read from Redis (one call)."""
FIRST_PLACE_AFTER_S = 0.25
"""A job still waiting this long after it was queued hears its place (before, it may be
claimed at once by a free worker anywhere, and would not have waited)."""


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


class RedisDispatcher:
    """The dispatcher whose queue is in Redis, shared by every router on it."""

    def __init__(
        self,
        settings: RouterSettings,
        registry: Registry,
        redis: aioredis.Redis,
        metrics: Metrics,
        *,
        name: str,
        away: UnavailableReason = answers.never_away,
    ) -> None:
        """``name``: this router in the consumer group (``consumer_name``); ``away``: why a
        model nobody serves is only away for a while (``answers``)."""
        self.settings = settings
        self.registry = registry
        self.name = name
        self._away = away
        self._output = JobOutput(metrics)
        self.outage = OutageLog()  # one log line as Redis goes, one as it is back
        self.rqueue = RedisJobQueue(
            redis,
            settings.redis_prefix,
            self.name,
            max_len=settings.max_queue,
            lease_ms=lease_ms(settings),
            outage=self.outage,
            resume_attempts=settings.resume_attempts,
        )
        self.tail = OutputTail(redis, settings.redis_prefix, self.name, outage=self.outage)
        self.directory = WorkerDirectory(
            redis,
            settings.redis_prefix,
            self.name,
            registry,
            interval_s=settings.heartbeat_interval,
            outage=self.outage,
        )
        self.holder = Holder(
            self.rqueue,
            registry,
            metrics,
            settings.max_requeues,
            settings.resume_attempts,
            prefix=settings.routing == "prefix",
            busier=self.directory.soon,
        )
        self.queue_backend = "redis"
        self.workers = WorkerSide(
            registry,
            self.holder.running,
            self.holder.kick,
            reattach=self.holder.reattach,
            changed=self.directory.changed,
            cache_changed=self.directory.soon,
            pace=HeartbeatPace(settings.heartbeat_interval, settings.heartbeat_rate),
        )
        self._redis = redis
        self._followed: dict[JobId, _Followed] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._depths: dict[ModelName, int] = {}
        self._oldest: dict[ModelName, float] = {}
        self._by_key: dict[str, int] = {}
        self._places: dict[JobId, int] = {}  # this router's waiting jobs: their places
        self._places_read = asyncio.Event()  # set (and replaced) after every read
        self._some_wait = asyncio.Event()  # a job was queued: positions are worth reading

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
                tg.create_task(self.run_positions())
                await asyncio.Event().wait()
            finally:
                self._tg = None

    # ------------------------------------------------------------ shared view

    def remote_workers(self) -> list[RemoteWorker]:
        return list(self.directory.remote)

    def heard_from_cluster(self) -> float | None:
        return self.directory.heard_at

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

    def oldest_waits(self) -> Mapping[ModelName, float]:
        """How long each model's oldest waiting job had waited at ``run_depths``'s last
        snapshot (by Redis's clock)."""
        return self._oldest

    async def run_positions(self) -> None:
        """Read the places of this router's waiting jobs in one script call every
        ``POSITIONS_INTERVAL_S`` while any wait, and at once when one is queued; idle (no
        call) while none waits."""
        while True:
            waiting = [
                f.job.id
                for f in self._followed.values()
                if f.job.state is JobState.QUEUED and f.enqueued.done()
            ]
            if not waiting:
                self._some_wait.clear()
                await self._some_wait.wait()
                continue
            with contextlib.suppress(*REDIS_DOWN):  # logged by the call; the last places stay
                self._places = await self.rqueue.positions(waiting)
            raise_if_cancelled()
            self._places_changed()
            # Again after the interval, or at once for a job queued meanwhile (its first
            # place is reported without delay; jobs queued during a read share the next).
            self._some_wait.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POSITIONS_INTERVAL_S):
                    await self._some_wait.wait()

    async def run_depths(self) -> None:
        """Count the jobs waiting in every queue, and the oldest one's wait, every heartbeat
        interval (one script call)."""
        while True:
            try:
                waiting = await self.rqueue.waiting_ages()
                self._by_key = await self.rqueue.waiting_by_key()
            except REDIS_DOWN:
                pass  # the outage is logged by the call; the last snapshot stays
            else:
                depths: Counter[ModelName] = Counter()
                oldest: dict[ModelName, float] = {}
                for (model, _), w in waiting.items():
                    depths[model] += w.count
                    if w.count:
                        oldest[model] = max(oldest.get(model, 0.0), w.oldest_s)
                self._depths, self._oldest = dict(depths), oldest
            raise_if_cancelled()
            await asyncio.sleep(self.settings.heartbeat_interval)

    # ------------------------------------------------------------ client side

    def check_served(self, model: ModelName, endpoint: Endpoint) -> None:
        answers.check_served(model, endpoint, self.registry, self.directory.remote, self._away)
        answers.check_fits(model, endpoint, self.registry, self.directory.remote)

    def submit(self, ask: Submission) -> Job:
        """The job waits in Redis for ``ask.tenant``'s share (``_enqueue``)."""
        if self._tg is None:
            raise Unavailable("The router is starting or stopping; retry in a moment.")
        self.check_served(ask.model, ask.endpoint)
        job = Job.of(ask, answers.context_need(ask, self.registry, self.directory.remote))
        followed = _Followed(job, asyncio.get_running_loop().create_future())
        self._followed[job.id] = followed
        followed.task = self._tg.create_task(self._follow(followed))
        return job

    async def _follow(self, followed: _Followed) -> None:
        job = followed.job
        try:
            if not await self._enqueue(followed):
                return
            async for delivered in self.tail.events(job.id):
                self._on_event(job, delivered.event)
                if await self._fits_nowhere(job, delivered.event):
                    return
        except (JobGone, events.BadEvent) as exc:
            self._fail(job, 502, _error(str(exc), "job_gone"))
        except REDIS_DOWN as exc:
            message = f"The router lost its connection to Redis ({exc}); retry the request."
            self._fail(job, 503, _error(message, "redis_unavailable"))
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
        queued = QueuedJob(job.id, job.model, job.endpoint, job.stream, job.body, job.need)
        try:
            await self.rqueue.enqueue(queued, self._share(job), self._hold(job))
        except KeyQueueFull as exc:
            log.info(
                "job %s model=%s key=%s refused: %d of its jobs waiting, its max-queued is %d",
                job.id,
                job.model,
                job.tenant.id,
                exc.waiting,
                exc.cap,
            )
            _refuse(followed.enqueued, answers.key_queue_full(job.model, exc.cap))
            return False
        except RedisQueueFull as exc:
            _refuse(
                followed.enqueued, QueueFull(str(exc), retry_after=answers.RETRY_AFTER_QUEUE_FULL_S)
            )
            return False
        except REDIS_DOWN as exc:
            _refuse(
                followed.enqueued,
                Unavailable(
                    f"The job queue (Redis) is unreachable: {exc}. Retry later.",
                    retry_after=answers.RETRY_AFTER_NO_WORKER_S,
                ),
            )
            return False
        followed.enqueued.set_result(None)
        self._some_wait.set()
        log.info("job %s model=%s key=%s queued in Redis", job.id, job.model, job.tenant.id)
        return True

    def _hold(self, job: Job) -> tuple[str, int] | None:
        """For whom the job waits in Redis, and how long (ms): the consumer (a router, or a
        pull worker) whose worker holds its prefix with a slot free (``directory.hold_for``),
        for ``--prefix-hold``."""
        hold_ms = int(self.settings.prefix_hold * 1000)
        if self.settings.routing != "prefix" or hold_ms <= 0 or job.endpoint not in PREFIXED:
            return None
        prefix = prefix_chain(job.model, job.body)
        claimer = self.directory.hold_for(job.model, job.endpoint, prefix, job.need)
        if claimer is None:
            return None
        if claimer != self.name:
            log.info(
                "job %s model=%s: held %d ms for %s, where a worker holds its prefix or model",
                job.id,
                job.model,
                hold_ms,
                claimer,
            )
        return claimer, hold_ms

    def _share(self, job: Job) -> Share:
        tenant = job.tenant
        batch = tenant.priority is Priority.BATCH
        fair = self.settings.scheduling == "fair"
        return Share(tenant.id, tenant.weight, batch, job.work, fair, tenant.max_queued)

    def _on_event(self, job: Job, event: events.JobEvent) -> None:
        match event:
            case events.Assigned(consumer=consumer, attempt=attempt, worker=worker):
                # The queue's as a consumer takes the job, then the consumer's naming the
                # worker it runs on (``x-shoal-worker``): before any output, in this order.
                if job.state is JobState.QUEUED or (worker and not job.state.finished):
                    job.worker_id = WorkerId(worker) if worker else None
                self._output.assigned(job, f"{consumer} (attempt {attempt})")
                self._places_changed()  # its queue_positions ends
            case events.Requeued(reason=reason) if job.state is JobState.STREAMING:
                self._output.going_on(job, reason)  # its worker was lost mid-answer
            case events.Requeued(reason=reason):
                self._output.requeued(job, reason)
            case _:
                self._output.deliver(job, event, time.monotonic())
                if events.is_final(event):
                    # What the worker that ran it holds now (a pull worker's, or another
                    # router's) is read within PUSH_GAP_S for the next hold_for, not only at
                    # this router's next heartbeat sync.
                    self.directory.soon()

    async def _fits_nowhere(self, job: Job, event: events.JobEvent) -> bool:
        """Withdrawn, with the 400, when back in Redis needing more context than any has."""
        if not isinstance(event, events.Requeued) or (need := event.need) is None:
            return False
        error = answers.too_long(job, need, self.registry, self.directory.remote)
        if error is None or not await self.rqueue.withdraw(job.id):
            return False
        log.info("job %s model=%s: no worker has %d tokens of context", job.id, job.model, need)
        self._fail(job, 400, error)
        return True

    def _fail(self, job: Job, status: int, error: ErrorBody) -> None:
        self._output.deliver(job, events.Failed(status, error), time.monotonic())

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
        await answers.wait_assigned(
            job,
            self.settings.max_wait,
            self._withdraw,
            lambda: answers.no_worker(
                job, self.settings.max_wait, self.registry, self.directory.remote
            ),
        )

    async def _withdraw(self, job: Job) -> bool:
        if not await self.rqueue.withdraw(job.id):
            return False  # a holder took it as the limit passed
        self._stop_following(job.id)
        return True

    def settle(self, job: Job, tokens: int) -> None:
        if self._tg is not None and self.settings.scheduling == "fair":
            self._tg.create_task(self._settle(job, tokens))

    async def _settle(self, job: Job, tokens: int) -> None:
        try:
            await self.rqueue.settle(job.model, job.endpoint, self._share(job), tokens)
        except REDIS_DOWN as exc:
            log.warning("job %s: its key's share not corrected, Redis unreachable: %s", job.id, exc)

    def queue_positions(self, job: Job) -> AsyncIterator[int] | None:
        return self._positions(job) if job.state is JobState.QUEUED else None

    async def _positions(self, job: Job) -> AsyncIterator[int]:
        """The job's place while it waits, as ``run_positions`` reads it: when it changes
        and every ``places.QUEUE_REPORT_S``; past ``--max-wait`` the 503 of ``wait_assigned``
        (which also raises the enqueue's refusal, a 429, as soon as it is known)."""
        followed = self._followed.get(job.id)
        if followed is not None:
            await asyncio.wait([followed.enqueued])
            if followed.enqueued.exception() is not None:
                await self.wait_assigned(job)  # raises the refusal
        # Every job passes through Redis: one a free worker takes at once does not count
        # as waiting (its stream starts with the worker's header, as in one router).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FIRST_PLACE_AFTER_S):
                await job.assigned.wait()
        deadline = job.queued_at + self.settings.max_wait
        async for place in places.report(
            job,
            deadline,
            lambda _now: self._places.get(job.id),
            lambda: self._places_read,
            lambda: self.wait_assigned(job),
        ):
            yield place

    def _places_changed(self) -> None:
        read, self._places_read = self._places_read, asyncio.Event()
        read.set()

    def waiting_by_key(self) -> Mapping[str, int]:
        """Every router's waiting jobs per key, from ``run_depths``'s last snapshot."""
        return self._by_key

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


def _refuse(enqueued: asyncio.Future[None], error: Exception) -> None:
    """Keep ``error`` for ``wait_assigned``; no "never retrieved" log if nobody waits."""
    enqueued.set_exception(error)
    enqueued.exception()  # marks it retrieved; awaiting the future still raises it


def _error(message: str, code: str) -> ErrorBody:
    return ErrorBody(message=message, type="server_error", code=code)
