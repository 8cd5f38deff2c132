"""Pull mode: the worker takes jobs straight from the Redis job queue, with no router link.

For sites where Redis is the one shared service (``shoal worker --redis-url``). The puller is
a consumer of ``RedisJobQueue``, as a router's ``Holder`` is for its WebSocket workers, with
this worker's slots::

    STARTING ──▶ CLAIMING ◀──▶ FULL     (every slot busy: waits for a job to end)
                    ▲  │
                    │  └──────▶ PAUSED  (the backend cannot serve: loading, restarting, failed)
                    └── backoff ── REDIS_DOWN (a claim failed: Redis unreachable)

CLAIMING is a blocking ``RedisJobQueue.claim`` (the routers' fair order, by start tag) for as
many jobs as there are free slots, for every (model, endpoint) this worker serves. FULL and
PAUSED wait on an event (a job ended, the backend or models changed), never polling. Each job
runs in the ``JobRunner``; its output comes back here (this class is its ``JobSink``) and is
published in one round trip per batch (whatever piled up while the previous publish was in
flight). Leases are renewed every ``renew_interval_s``; cancellations stop the job in the
runner. A job whose run fails here runs again, goes on elsewhere from what its client has,
waits for a worker with more context or fails, as ``queue.failure.after_failure`` says (the
rule a router follows for its own workers): given back to its queue for any worker, or
failed with its error. A job is claimed only when its need (``QueuedJob.need``) fits this worker's
context per slot (the claim's ``limits``); one whose prompt llama-server refused anyway as
too long goes back needing more, for a worker with a larger context (the client's router
answers the 400 if there is none). A periodic ``sweep`` puts back the jobs of holders that
died (a killed pull worker, a dead router). Publishing, renewals, cancellations and sweeps are
``redis_queue.consumer.ConsumerLoops``, shared with the router's ``Holder``.

Its entry in the worker list (``redis_presence``) names its consumer and what its slots hold,
so a router whose request's prefix this worker holds (with a slot free) holds the job for it
in Redis (``redis_queue/claim.py``): this worker's claim takes it at once (woken by its
arrival), every other claimer passes it over until the hold ends.

During a Redis outage the jobs held keep running; a publish that still fails after the
queue's ``outage_s`` stops its job here (the sweep recovers it once Redis is back).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import redis.asyncio as aioredis

from shoal.jobs import events
from shoal.jobs.answer import AnswerSoFar, trail_of
from shoal.jobs.failure import Next, Sent, after_failure, failure_of
from shoal.lifecycle import Lifecycle, Transitions
from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import (
    BackendState,
    Endpoint,
    JobDone,
    JobFailed,
    JobLoading,
    JobResult,
    JobStart,
    ModelInfo,
    Register,
)
from shoal.redis_queue.claimed import Claimed
from shoal.redis_queue.consumer import ConsumerLoops, GiveBack, Outgoing
from shoal.redis_queue.streams import LEASE_MS, RedisJobQueue
from shoal.redis_queue.support import REDIS_DOWN, RETRY_MAX_DELAY_S, raise_if_cancelled
from shoal.worker.backoff import Backoff
from shoal.worker.hardware import MemoryProbe
from shoal.worker.jobs.runner import JobRunner
from shoal.worker.jobs.sink import JobOutcome
from shoal.worker.link.redis_presence import Presence, Summary, summary

log = logging.getLogger(__name__)

SOCKET_TIMEOUT_S = 10.0
"""The Redis client's socket timeout: longer than the queue's blocking reads (2 s)."""
CONNECT_TIMEOUT_S = 2.0
MAX_REQUEUES = 2
RESUME_ATTEMPTS = 2
"""Times a job that failed retryably here goes back to its queue (the routers' default)."""
STOP_TIMEOUT_S = 2.0
"""How long a stopping worker tries to hand back its jobs (else the sweep recovers them)."""

_TAKES_JOBS = frozenset({BackendState.READY, BackendState.UNLOADED})
"""Unloaded after idling: the runner's gate loads it again and the job waits."""


class PullState(enum.StrEnum):
    STARTING = "starting"
    CLAIMING = "claiming"
    FULL = "full"
    PAUSED = "paused"
    REDIS_DOWN = "redis-down"


ALLOWED = Transitions(
    {
        PullState.STARTING: frozenset({PullState.CLAIMING, PullState.FULL, PullState.PAUSED}),
        PullState.CLAIMING: frozenset({PullState.FULL, PullState.PAUSED, PullState.REDIS_DOWN}),
        PullState.FULL: frozenset({PullState.CLAIMING, PullState.PAUSED}),
        PullState.PAUSED: frozenset({PullState.CLAIMING, PullState.FULL}),
        PullState.REDIS_DOWN: frozenset({PullState.CLAIMING, PullState.FULL, PullState.PAUSED}),
    }
)
"""The claim loop's lifecycle; staying in a state is no move (the loop re-plans each turn)."""


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    """What the claim loop does next: claim ``count`` jobs of ``keys``, or wait (``state``);
    ``limits``: the most context a job of each key may need (its model's context per slot;
    absent: any)."""

    state: PullState
    keys: tuple[tuple[ModelName, Endpoint], ...] = ()
    count: int = 0
    why: str = ""
    limits: dict[tuple[ModelName, Endpoint], int] = field(default_factory=dict)


def plan_claim(
    models: Iterable[ModelInfo], backend: BackendState, slots: int, busy: int
) -> ClaimPlan:
    """Claim for every (model, endpoint) served, as many jobs as slots are free, each no
    longer than a slot holds."""
    models = tuple(models)
    keys = tuple(sorted({(m.name, e) for m in models for e in m.endpoints}))
    if backend not in _TAKES_JOBS:
        return ClaimPlan(PullState.PAUSED, why=f"(backend {backend})")
    if not keys:
        return ClaimPlan(PullState.PAUSED, why="(no model yet)")
    if busy >= slots:
        return ClaimPlan(PullState.FULL, why=f"({busy}/{slots} slots busy)")
    limits = {(m.name, e): m.context_length for m in models for e in m.endpoints}
    known = {key: n for key, n in limits.items() if n is not None}
    free = slots - busy
    return ClaimPlan(PullState.CLAIMING, keys, free, f"({free} free slot(s))", known)


def consumer_name(worker_id: str) -> str:
    """The worker's name in the queue's consumer group (key-safe)."""
    return "worker-" + re.sub(r"[^A-Za-z0-9_.\-]", "-", worker_id)[:120]


def redis_address(url: str) -> str:
    """Where ``url`` points, for logs: host:port (never the password in it)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix:{parts.path}"
    return f"{parts.hostname}:{parts.port or 6379}"


def redis_client(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S
    )


@dataclass(eq=False, slots=True)
class Held:
    """A claimed job running in this worker's runner."""

    claimed: Claimed
    answer: AnswerSoFar = field(default_factory=AnswerSoFar)
    """What the client has (once it has anything, the job can no longer run again)."""


class RedisPuller:
    """Claims jobs for this worker's slots from Redis and publishes their output there."""

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        register: Callable[[], Register],
        *,
        memory: MemoryProbe,
        lease_ms: int = LEASE_MS,
        max_requeues: int = MAX_REQUEUES,
        resume_attempts: int = RESUME_ATTEMPTS,
        backoff: Backoff | None = None,
    ) -> None:
        """``register`` describes the worker (id, models, slots...) as it would to a router."""
        first = register()
        self.worker_id = first.worker_id
        self.slots = first.slots
        self.register = register
        self.queue = RedisJobQueue(
            redis,
            prefix,
            consumer_name(first.worker_id),
            lease_ms=lease_ms,
            resume_attempts=resume_attempts,
        )
        self.runner = JobRunner(self)
        self.presence = Presence(
            redis, prefix, first.worker_id, self.describe, outage=self.queue.outage
        )
        self.memory = memory
        self.max_requeues = max_requeues
        self.resume_attempts = resume_attempts
        self.backoff = backoff or Backoff(cap=RETRY_MAX_DELAY_S * 5)
        self._life = Lifecycle(f"pull worker {self.worker_id}", ALLOWED, PullState.STARTING, log)
        self.models: tuple[ModelInfo, ...] = first.models
        self.backend_state = first.state
        self.detail = ""
        self.cached_blocks: tuple[int, ...] = ()
        """What llama-server's slots hold: in the entry, for every router to match on."""
        self.connected_at = time.time()
        self._held: dict[JobId, Held] = {}
        self._wake = asyncio.Event()  # a slot freed, the backend or the models changed
        self.loops = ConsumerLoops(self.queue, self)
        self.draining = False
        """Told to stop (``drain``): it claims no more jobs."""

    @property
    def running(self) -> int:
        """Jobs held (claimed and not ended here): what counts against the slots."""
        return len(self._held)

    @property
    def state(self) -> PullState:
        return self._life.state

    def _move(self, state: PullState, why: str) -> None:
        if state is not self.state:
            self._life.move(state, why)

    # ------------------------------------------------------------ the worker's callbacks

    def on_models(self, models: tuple[ModelInfo, ...]) -> None:
        self.models = models
        self._wake.set()
        self.presence.changed()

    def on_backend_state(self, state: BackendState, detail: str) -> None:
        self.backend_state, self.detail = state, detail
        self._wake.set()
        self.presence.changed()

    def on_cache(self, blocks: tuple[int, ...]) -> None:
        self.cached_blocks = blocks
        self.presence.soon()

    def drain(self, timeout_s: float) -> None:
        """Claim no more jobs (the worker stops once those it holds are answered, at most
        ``timeout_s`` from now); the routers see it draining in its entry."""
        self.draining = True
        self._wake.set()
        self.presence.changed()

    async def describe(self) -> Summary:
        """This worker's entry in the cluster's worker list."""
        reading = await self.memory.read()
        return summary(
            self.register(),
            detail=self.detail,
            running_jobs=self.running,
            ram_available_bytes=reading.ram_available_bytes,
            gpu_free_bytes=reading.gpu_free_bytes,
            gpu_telemetry=reading.gpus,
            connected_at=self.connected_at,
            consumer=self.queue.consumer,
            cached_blocks=self.cached_blocks,
            draining=self.draining,
            running_by_model=dict(Counter(h.claimed.job.model for h in self._held.values())),
        )

    # ------------------------------------------------------------ running

    async def run(self) -> None:
        """Claim and serve jobs until cancelled; then hand back what is still held."""
        log.info("pull worker %s: consumer %s", self.worker_id, self.queue.consumer)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.presence.run())
                for loop in (
                    self.loops.run_publisher,
                    self.loops.run_renewals,
                    self.loops.run_cancellations,
                    self.loops.run_sweeps,
                ):
                    tg.create_task(loop())
                # A task, so that a runner task created before ``run()`` opens first.
                tg.create_task(self._claims())
        finally:
            await self._hand_back()

    async def _claims(self) -> None:
        attempt = 0
        while True:
            raise_if_cancelled()
            if self.draining:
                log.info("pull worker %s: draining, claims no more jobs", self.worker_id)
                return
            plan = plan_claim(self.models, self.backend_state, self.slots, self.running)
            self._move(plan.state, plan.why)
            if plan.state is not PullState.CLAIMING:
                await self._sleep_until_woken()
                continue
            try:
                claimed = await self.queue.claim(plan.keys, plan.count, limits=plan.limits)
            except REDIS_DOWN as exc:
                self.queue.outage.failed("claim", exc)
                delay = self.backoff.delay(attempt)
                attempt += 1
                self._move(PullState.REDIS_DOWN, f"({exc}); claiming again in {delay:.1f} s")
                await asyncio.sleep(delay)
                continue
            attempt = 0
            if self.draining:  # it drained while that claim waited: the jobs go back
                for c in claimed:
                    self._send(GiveBack(c, f"worker {self.worker_id} is draining"))
                continue
            if not all([self._start(c) for c in claimed]):
                self._move(PullState.PAUSED, "(the job runner is not running)")
                await self._sleep_until_woken()

    async def _sleep_until_woken(self) -> None:
        """Until a job ends or the backend or models change."""
        self._wake.clear()
        await self._wake.wait()

    def _start(self, claimed: Claimed) -> bool:
        """Run the job; False (it goes back to its queue) if the runner is not running.

        Start ``runner.run()`` before ``run()``: the first claim then finds the runner's task
        group open (tasks start in the order they were created); it closes as the worker stops.
        """
        qjob = claimed.job
        # A job that goes on with an answer a lost worker began has output already.
        resume = claimed.resume
        answer = AnswerSoFar() if resume is None else AnswerSoFar.going_on(resume)
        self._held[qjob.id] = Held(claimed, answer)
        start = JobStart(
            job_id=qjob.id,
            model=qjob.model,
            endpoint=qjob.endpoint,
            stream=qjob.stream,
            body=dict(qjob.body),
            resume=claimed.resume,
        )
        try:
            self.runner.start(start)
        except RuntimeError:  # the runner is not running (the worker is stopping)
            self._release(qjob.id)
            self._send(GiveBack(claimed, f"worker {self.worker_id} cannot run jobs now"))
            return False
        self._send((claimed, events.Assigned(self.queue.consumer, claimed.attempt, self.worker_id)))
        self.presence.soon()  # one slot fewer free: routers hold no job for a full worker
        log.info(
            "job %s model=%s (attempt %d) runs on pull worker %s (%d/%d slots)",
            qjob.id,
            qjob.model,
            claimed.attempt,
            self.worker_id,
            self.running,
            self.slots,
        )
        return True

    def _release(self, job_id: JobId) -> Held | None:
        held = self._held.pop(job_id, None)
        if held is not None:
            self._wake.set()
            self.presence.soon()
        return held

    # ------------------------------------------------------------ the runner's sink

    def chunk(self, job_id: JobId, data: str, tokens: tuple[int, ...] | None = None) -> None:
        held = self._held.get(job_id)
        if held is None:
            return  # stopped (cancelled, taken over) while the chunk was on its way
        held.answer.take(data, tokens)
        if not held.claimed.job.stream:
            return  # progress: kept to go on from, the answer is published whole
        self._send((held.claimed, events.Data(data)))
        if tokens is not None or held.answer.tokens:  # else nothing is known of its tokens
            self._send((held.claimed, trail_of(tokens, held.answer)))

    def loading(self, message: JobLoading) -> None:
        """The job waits while its model loads here: a streamed answer shows the client
        ``: loading model=…`` (``events.Loading``, unnumbered: not output)."""
        held = self._held.get(message.job_id)
        if held is not None and held.claimed.job.stream:
            self._send((held.claimed, events.Loading(message.model)))

    def send(self, message: JobOutcome, /) -> None:
        held = self._release(message.job_id)
        if held is None:
            return
        match message:
            case JobDone():
                self._send((held.claimed, events.Done()))
            case JobResult(body=body):
                self._send((held.claimed, events.Result(body)))
            case JobFailed():
                self._failed(held, message)

    def _failed(self, held: Held, failed: JobFailed) -> None:
        """Do with a job whose run failed here what ``queue.failure.after_failure`` says
        (the rule a router follows for its workers too)."""
        claimed, answer = held.claimed, held.answer
        job = claimed.job
        why = f"worker {self.worker_id}: {failed.error.message}"
        sent = Sent.of(answer, job.endpoint, job.stream, claimed.attempt, claimed.resumes)
        step = after_failure(failure_of(failed), sent, self.max_requeues, self.resume_attempts)
        if step is Next.GO_ON:
            resume = answer.continuation(job.endpoint, claimed.resumes, self.resume_attempts)
            assert resume is not None  # ``after_failure`` goes on only where it can
            log.warning(
                "job %s model=%s: %s; going on elsewhere after %d tokens",
                job.id,
                job.model,
                why,
                len(resume.tokens),
            )
            self._send(GiveBack(claimed, why, resume))
        elif step is Next.RUN_AGAIN:
            self._send(GiveBack(claimed, why))
        elif step is Next.WAIT_FOR_CONTEXT:
            need = max(job.need, failed.context_needed or 0)
            log.info(
                "job %s model=%s: pull worker %s has too little context for its prompt; it "
                "needs %d tokens",
                job.id,
                job.model,
                self.worker_id,
                need,
            )
            self._send(GiveBack(claimed, why, need=need))
        else:
            log.warning(
                "job %s model=%s failed on pull worker %s: %s",
                job.id,
                job.model,
                self.worker_id,
                why,
            )
            self._send((claimed, events.Failed(failed.status, failed.error)))

    def _send(self, item: Outgoing) -> None:
        self.loops.send(item)

    # ------------------------------------------------------------ Redis side

    def held_claims(self) -> list[Claimed]:
        return [h.claimed for h in self._held.values()]

    def stop_job(self, job_id: JobId) -> Claimed | None:
        held = self._stop(job_id)
        return held.claimed if held is not None else None

    def _stop(self, job_id: JobId) -> Held | None:
        """Stop a job here (cancelled, taken over): cancel it in the runner, free its slot."""
        held = self._release(job_id)
        if held is not None:
            self.runner.cancel(job_id)
            log.info("job %s stopped on pull worker %s", job_id, self.worker_id)
        return held

    async def _hand_back(self) -> None:
        """Stopping: publish what is pending and give back the jobs still held, so they run
        again elsewhere now rather than after the lease (one that had answered in part fails).
        Runs while the cancellation is handled: no ``raise_if_cancelled`` here."""
        for job_id in list(self._held):
            held = self._stop(job_id)
            if held is not None:
                self.loops.send(GiveBack(held.claimed, f"worker {self.worker_id} stopped"))
        batch = self.loops.take_pending()
        if not batch:
            return
        with contextlib.suppress(*REDIS_DOWN, TimeoutError):
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await self.loops.publish(batch)
                log.info("pull worker %s: handed back %d event(s)", self.worker_id, len(batch))
