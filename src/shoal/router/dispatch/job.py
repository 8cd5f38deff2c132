"""A request's life inside the router: an explicit state machine plus its event inbox.

    QUEUED ──assign──▶ ASSIGNED ──first chunk──▶ STREAMING ──▶ SUCCEEDED
       ▲ ▲                │                         │ │
       │ └──requeue───────┘ (worker lost, no output)│ ├──▶ FAILED
       └──resume────────────(worker lost mid-answer)┘ │
    any live state ────────────────────────────────────┴──▶ CANCELLED

``ALLOWED`` is that diagram as a table (``shoal.lifecycle``); any other move raises
``IllegalTransition``.

The HTTP handler reads ``Job.events``: the outcome events of ``shoal.jobs.events`` (the one
vocabulary for a job's outcome, in this router and on the Redis queue), which ``output.py``
delivers for either dispatcher.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from shoal.jobs.events import ClientEvent
from shoal.lifecycle import Transitions
from shoal.protocol.ids import JobId, ModelName, WorkerId, new_job_id
from shoal.protocol.messages import Continuation, Endpoint
from shoal.router.dispatch.fair_queue import ANONYMOUS, Tenant, estimated_work

log = logging.getLogger(__name__)


class JobState(enum.StrEnum):
    QUEUED = "queued"
    ASSIGNED = "assigned"
    STREAMING = "streaming"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return ALLOWED.terminal(self)


ALLOWED = Transitions(
    {
        JobState.QUEUED: {JobState.ASSIGNED, JobState.FAILED, JobState.CANCELLED},
        JobState.ASSIGNED: {
            JobState.STREAMING,
            JobState.QUEUED,
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
        },
        JobState.STREAMING: {
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.QUEUED,
        },
        JobState.SUCCEEDED: set(),
        JobState.FAILED: set(),
        JobState.CANCELLED: set(),
    },
    level=logging.DEBUG,  # several moves per request
)


@dataclass(frozen=True, slots=True)
class Submission:
    """What a request asks of the job path (``Dispatcher.submit``)."""

    model: ModelName
    endpoint: Endpoint
    stream: bool
    body: dict[str, Any]
    tenant: Tenant = ANONYMOUS
    """Whom the job queues for (``fair_queue``)."""
    key_id: str | None = None
    """The API key that submits it (usage and token limits are charged to it)."""


@dataclass(eq=False)
class Job:
    id: JobId
    model: ModelName
    endpoint: Endpoint
    stream: bool
    body: dict[str, Any]
    state: JobState = JobState.QUEUED
    worker_id: WorkerId | None = None
    requeues: int = 0
    resumes: int = 0
    """Times its answer went on on another worker (``--resume-attempts``)."""
    preemptions: int = 0
    """Times it was paused for a job of a tenant below its share (``preemption``)."""
    resume: Continuation | None = None
    """What the client has of its answer, while it waits to go on (None: a fresh run)."""
    lost_at: float | None = None
    """When its worker was lost mid-answer (until the resumed answer's first chunk)."""
    avoid: WorkerId | None = None
    """The worker that last failed it mid-answer: another goes on with it, if one can."""
    created: float = field(default_factory=time.monotonic)
    queued_at: float = field(default_factory=time.monotonic)
    last_chunk_at: float = 0.0
    key_id: str | None = None
    """The API key that submitted the job (usage and token limits are charged to it)."""
    tenant: Tenant = ANONYMOUS
    """Whom the job is queued for: its share of the workers (``fair_queue``)."""
    work: float = 1.0
    """Its estimated work in tokens (``fair_queue.estimated_work``), settled when it ends."""
    need: int = 0
    """The tokens of context a worker's slot must have to be given it (``need.py``): set as
    it is accepted, raised when a worker's llama-server refused its prompt as too long."""
    prefix: tuple[int, ...] = ()
    """Its prefix chain (``protocol.prefix``) once placed with ``--routing prefix``: its
    worker holds it while it runs."""
    events: asyncio.Queue[ClientEvent] = field(default_factory=asyncio.Queue)
    assigned: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def of(cls, ask: Submission, need: int = 0) -> Job:
        """A new job for ``ask``, its work estimated from its body; ``need``: the context a
        worker's slot must have for it (``answers.context_need``)."""
        return cls(
            id=new_job_id(),
            model=ask.model,
            endpoint=ask.endpoint,
            stream=ask.stream,
            body=ask.body,
            key_id=ask.key_id,
            tenant=ask.tenant,
            work=estimated_work(ask.body),
            need=need,
        )

    def transition(self, new: JobState, why: str = "") -> None:
        self.state = ALLOWED.move(self, self.state, new, why, log)
        if new is JobState.ASSIGNED:
            self.assigned.set()
        elif new is JobState.QUEUED:
            self.assigned.clear()
            self.queued_at = time.monotonic()

    def __str__(self) -> str:
        """What its log lines name it by."""
        return f"job {self.id} model={self.model} worker={self.worker_id}"

    def deliver(self, event: ClientEvent) -> None:
        self.events.put_nowait(event)
