"""Where async job records live: one ``JobStore`` protocol, two backends.

``MemoryJobStore`` keeps them in this router (lost on restart); ``RedisJobStore`` shares them
between every router on the same Redis and prefix, so a job created through one router can be
read or cancelled through another. Both keep a finished record for ``ttl_s`` seconds.

Every transition is atomic and conditional on the record's current status, so a cancel racing
the job's end has exactly one winner: the loser's call returns None (or ``cancelled=False``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from shoal.router.async_jobs.records import AsyncJobId, JobRecord
from shoal.router.errors import NotFound, QueueFull, RouterError, Unavailable

DEFAULT_JOB_TTL_S = 3600.0
"""How long a finished job's result is kept unless configured otherwise."""


@dataclass(frozen=True, slots=True)
class Cancellation:
    """What ``JobStore.cancel`` found: no record, a record it cancelled, or one already ended."""

    record: JobRecord | None
    cancelled: bool


class JobStore(Protocol):
    ttl_s: float

    async def create(self, record: JobRecord) -> None:
        """Store a new (queued) record."""

    async def get(self, job_id: AsyncJobId) -> JobRecord | None:
        """The record, or None if it never existed or has expired."""

    async def set_running(self, job_id: AsyncJobId) -> JobRecord | None:
        """Move a queued job to running; None if it is not queued (cancelled, gone)."""

    async def finish(
        self,
        job_id: AsyncJobId,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> JobRecord | None:
        """End a live job with its result or error (starting the TTL); None if it had
        already ended (cancelled meanwhile) or is gone. ``IllegalTransition`` if a queued job
        would succeed (it must be set running first)."""

    async def cancel(self, job_id: AsyncJobId) -> Cancellation:
        """Cancel a queued or running job (starting the TTL)."""

    async def set_progress(self, job_id: AsyncJobId, progress: dict[str, Any]) -> None:
        """Record how far a running job is (ignored once it is not running)."""

    async def set_queue_position(self, job_id: AsyncJobId, place: int) -> None:
        """Record where a queued job stands (ignored once it is not queued)."""

    async def run(self, on_cancel: Callable[[AsyncJobId], None]) -> None:
        """The store's own loop, run until cancelled: the memory store sweeps expired records
        on a timer; the Redis store calls ``on_cancel`` for jobs cancelled by any router."""


# ---------------------------------------------------------------- errors the jobs API answers


class JobNotFound(NotFound):
    code = "job_not_found"

    def __init__(self, job_id: str, ttl_s: float) -> None:
        super().__init__(
            f"No job {job_id!r}: it does not exist, was created with another API key, or "
            f"ended more than {ttl_s:g} s ago and its result was dropped. Submit it again "
            "with POST /v1/jobs.",
            param="id",
        )


class JobAlreadyFinished(RouterError):
    status = 409
    type = "invalid_request_error"
    code = "job_finished"

    def __init__(self, record: JobRecord) -> None:
        super().__init__(
            f"Job {record.id} has already {record.status.value}, so it cannot be cancelled; "
            f"read its outcome with GET /v1/jobs/{record.id}.",
            param="id",
        )


class TooManyJobs(QueueFull):
    code = "too_many_jobs"


class JobStoreUnavailable(Unavailable):
    code = "job_store_unavailable"
