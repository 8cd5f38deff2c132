"""An async job as the jobs API keeps it: a frozen record plus its state machine.

    QUEUED ──runner started──▶ RUNNING ──▶ SUCCEEDED (result)
       │                          ├──────▶ FAILED (error)
       ├──refused before running──┴──────▶ FAILED (error)
       └──DELETE (either live state)─────▶ CANCELLED

A record never changes in place: ``moved`` returns the next one, or raises
``IllegalTransition`` (``shoal.lifecycle``) when the move is not in ``ALLOWED``. Every store
backend applies the same table (the Redis one inside a script, from ``ALLOWED.sources``).
"""

from __future__ import annotations

import enum
import logging
import re
import secrets
from dataclasses import dataclass, replace
from typing import Any, NewType

from shoal.lifecycle import Transitions
from shoal.protocol.messages import Endpoint

log = logging.getLogger(__name__)

AsyncJobId = NewType("AsyncJobId", str)
"""The id clients use with /v1/jobs; not the dispatcher's ``JobId`` (a job may take several)."""

_ID_PREFIX = "ajob_"
_ID_PATTERN = re.compile(r"ajob_[0-9a-f]{32}")


def new_async_job_id() -> AsyncJobId:
    """128 random bits: an id cannot be guessed, so an open router leaks no one's results."""
    return AsyncJobId(_ID_PREFIX + secrets.token_hex(16))


def parse_async_job_id(text: str) -> AsyncJobId | None:
    """``text`` as a job id, or None when it cannot be one (then no store is asked)."""
    return AsyncJobId(text) if _ID_PATTERN.fullmatch(text) else None


class JobType(enum.StrEnum):
    """What an async job runs. Image types join here, each with the way it is run."""

    CHAT_COMPLETION = "chat_completion"
    COMPLETION = "completion"
    EMBEDDING = "embedding"
    TXT2IMG = "txt2img"
    IMG2IMG = "img2img"

    @property
    def endpoint(self) -> Endpoint:
        return _ENDPOINTS[self]


_ENDPOINTS = {
    JobType.CHAT_COMPLETION: Endpoint.CHAT,
    JobType.COMPLETION: Endpoint.COMPLETIONS,
    JobType.EMBEDDING: Endpoint.EMBEDDINGS,
    JobType.TXT2IMG: Endpoint.IMAGE_GENERATIONS,
    JobType.IMG2IMG: Endpoint.IMAGE_EDITS,
}


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


ALLOWED = Transitions(
    {
        JobStatus.QUEUED: {JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED},
        JobStatus.RUNNING: {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED},
        JobStatus.SUCCEEDED: set(),
        JobStatus.FAILED: set(),
        JobStatus.CANCELLED: set(),
    }
)
"""A record has ended in a status it cannot leave (``ALLOWED.terminal``)."""


@dataclass(frozen=True, slots=True)
class JobRecord:
    """One async job. ``result`` is the answer's JSON object; ``error`` an OpenAI error object
    (``message``, ``type``, ``param``, ``code``). Times are Unix seconds."""

    id: AsyncJobId
    type: JobType
    model: str
    owner: str | None
    """The id of the API key that created the job; only that key may see it."""
    created_at: float
    status: JobStatus = JobStatus.QUEUED
    finished_at: float | None = None
    expires_at: float | None = None
    """When a finished record is forgotten (``finished_at`` + the store's TTL)."""
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    progress: dict[str, Any] | None = None
    """How far a running image job is: ``{"step", "total_steps", "progress", "images"}``."""
    queue_position: int | None = None
    """While it waits for a worker: how many jobs will go before it (None if not known)."""

    def moved(self, new: JobStatus, **changes: Any) -> JobRecord:
        who = f"async job {self.id} model={self.model}"
        return replace(self, status=ALLOWED.move(who, self.status, new, "", log), **changes)

    def ended(
        self,
        now: float,
        ttl_s: float,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        cancelled: bool = False,
    ) -> JobRecord:
        """The record ended: cancelled, failed with ``error``, or succeeded with ``result``."""
        if cancelled:
            new = JobStatus.CANCELLED
        elif (result is None) == (error is None):
            raise ValueError("a finished job has a result or an error, not both or neither")
        else:
            new = JobStatus.SUCCEEDED if error is None else JobStatus.FAILED
        return self.moved(new, finished_at=now, expires_at=now + ttl_s, result=result, error=error)

    def visible_to(self, key_id: str | None) -> bool:
        return self.owner == key_id

    def to_api(self) -> dict[str, Any]:
        """The job as ``GET /v1/jobs/{id}`` answers it (OpenAI-like: ``object: "job"``)."""
        return {
            "id": self.id,
            "object": "job",
            "type": self.type.value,
            "model": self.model,
            "status": self.status.value,
            "created_at": int(self.created_at),
            "finished_at": None if self.finished_at is None else int(self.finished_at),
            "expires_at": None if self.expires_at is None else int(self.expires_at),
            "result": self.result,
            "error": self.error,
            "progress": self.progress,
            "queue_position": (self.queue_position if self.status is JobStatus.QUEUED else None),
        }
