"""Where a running job's output goes: the router link's ``Outbox``, or Redis in pull mode."""

from __future__ import annotations

from typing import Protocol

from shoal.protocol.ids import JobId
from shoal.protocol.messages import JobDone, JobFailed, JobResult

JobOutcome = JobDone | JobResult | JobFailed
"""How a job ends, as ``Backend`` and ``JobRunner`` report it."""


class JobSink(Protocol):
    """Takes a job's output without blocking: streamed chunks, then one outcome."""

    def chunk(self, job_id: JobId, data: str, tokens: tuple[int, ...] | None = None) -> None:
        """``tokens``: the ids whose text this chunk completes (``Chunk.tokens``)."""
        ...

    def send(self, message: JobOutcome, /) -> None: ...
