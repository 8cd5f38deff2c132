"""Async job records in this router's memory: a dict plus an expiry heap.

Finished records are dropped ``ttl_s`` after they end: lazily on every access (so an expired
record is never served), and by ``run``, which sleeps until the next expiry or until a sooner
one is added, never polling. At most ``max_finished`` finished records are kept (results
can be large): past that, the one that would expire first goes early. Live records stay until
they end; they vanish with the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from shoal.router.async_jobs.records import ALLOWED, AsyncJobId, JobRecord, JobStatus
from shoal.router.async_jobs.store.interface import DEFAULT_JOB_TTL_S, Cancellation

log = logging.getLogger(__name__)

MAX_FINISHED = 10_000
"""Most finished records (with their results) one router keeps in memory."""


class MemoryJobStore:
    """``JobStore`` for a single router. Every method completes without awaiting anything,
    so each is atomic on the event loop."""

    def __init__(
        self,
        ttl_s: float = DEFAULT_JOB_TTL_S,
        *,
        max_finished: int = MAX_FINISHED,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_finished = max_finished
        self.clock = clock
        self._records: dict[AsyncJobId, JobRecord] = {}
        self._expiry: list[tuple[float, AsyncJobId]] = []
        self._sooner = asyncio.Event()

    def __len__(self) -> int:
        return len(self._records)

    async def create(self, record: JobRecord) -> None:
        if record.id in self._records:
            raise ValueError(f"async job {record.id} exists already")
        self._records[record.id] = record

    async def get(self, job_id: AsyncJobId) -> JobRecord | None:
        self.sweep()
        return self._records.get(job_id)

    async def set_running(self, job_id: AsyncJobId) -> JobRecord | None:
        self.sweep()
        record = self._records.get(job_id)
        if record is None or record.status is not JobStatus.QUEUED:
            return None
        return self._put(record.moved(JobStatus.RUNNING))

    async def finish(
        self,
        job_id: AsyncJobId,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> JobRecord | None:
        self.sweep()
        record = self._records.get(job_id)
        if record is None or ALLOWED.terminal(record.status):
            return None
        now = self.clock()
        return self._ended(record.ended(now, self.ttl_s, result=result, error=error), now)

    async def cancel(self, job_id: AsyncJobId) -> Cancellation:
        self.sweep()
        record = self._records.get(job_id)
        if record is None or ALLOWED.terminal(record.status):
            return Cancellation(record, cancelled=False)
        now = self.clock()
        ended = self._ended(record.ended(now, self.ttl_s, cancelled=True), now)
        return Cancellation(ended, cancelled=True)

    async def set_progress(self, job_id: AsyncJobId, progress: dict[str, Any]) -> None:
        record = self._records.get(job_id)
        if record is not None and record.status is JobStatus.RUNNING:
            self._records[job_id] = replace(record, progress=progress)

    async def set_queue_position(self, job_id: AsyncJobId, place: int) -> None:
        record = self._records.get(job_id)
        if record is not None and record.status is JobStatus.QUEUED:
            self._records[job_id] = replace(record, queue_position=place)

    async def run(self, on_cancel: Callable[[AsyncJobId], None]) -> None:
        """Drop records as they expire, until cancelled. (Cancels are all local here, so
        ``on_cancel`` is never called: the jobs service cancels its own tasks.)"""
        while True:
            self.sweep()
            self._sooner.clear()
            delay = self._expiry[0][0] - self.clock() if self._expiry else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._sooner.wait()

    def sweep(self) -> int:
        """Drop every record whose time is up; how many were dropped."""
        now = self.clock()
        dropped = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, job_id = heapq.heappop(self._expiry)
            if self._records.pop(job_id, None) is not None:
                dropped += 1
                log.debug("async job %s: result expired", job_id)
        return dropped

    def _put(self, record: JobRecord) -> JobRecord:
        self._records[record.id] = record
        return record

    def _ended(self, record: JobRecord, now: float) -> JobRecord:
        expires_at = now + self.ttl_s
        if not self._expiry or expires_at < self._expiry[0][0]:
            self._sooner.set()  # the timer in ``run`` must wake sooner
        heapq.heappush(self._expiry, (expires_at, record.id))
        self._put(record)
        while len(self._expiry) > self.max_finished:
            _, early = heapq.heappop(self._expiry)
            self._records.pop(early, None)
            log.info("async job %s: result dropped early (over %d kept)", early, self.max_finished)
        return record
