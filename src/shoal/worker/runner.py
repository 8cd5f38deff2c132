"""The worker's running jobs: one task each, inside one task group, cancellable by id."""

from __future__ import annotations

import asyncio
import logging

from shoal.protocol.ids import JobId
from shoal.protocol.messages import JobStart
from shoal.worker.backend import Backend
from shoal.worker.outbox import Outbox

log = logging.getLogger(__name__)


class JobRunner:
    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.backend: Backend | None = None
        self._tasks: dict[JobId, asyncio.Task[None]] = {}
        self._group: asyncio.TaskGroup | None = None

    @property
    def running(self) -> int:
        return len(self._tasks)

    async def run(self, backend: Backend) -> None:
        """Own the task group jobs run in, until cancelled."""
        self.backend = backend
        async with asyncio.TaskGroup() as tg:
            self._group = tg
            try:
                await asyncio.Event().wait()
            finally:
                self._group = None
                self.cancel_all("worker stopping")

    def start(self, job: JobStart) -> None:
        if self._group is None or self.backend is None:
            raise RuntimeError("job runner is not running")
        log.info(
            "job %s model=%s endpoint=%s stream=%s: started",
            job.job_id,
            job.model,
            job.endpoint.value,
            job.stream,
        )
        task = self._group.create_task(self._run(job, self.backend))
        self._tasks[job.job_id] = task

    async def _run(self, job: JobStart, backend: Backend) -> None:
        try:
            await backend.run(job, self.outbox)
            log.info("job %s: finished", job.job_id)
        except asyncio.CancelledError:
            log.info("job %s: cancelled, backend request closed", job.job_id)
            raise
        finally:
            self._tasks.pop(job.job_id, None)

    def cancel(self, job_id: JobId) -> None:
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()

    def cancel_all(self, why: str) -> None:
        if self._tasks:
            log.info("cancelling %d job(s): %s", len(self._tasks), why)
        for task in list(self._tasks.values()):
            task.cancel()
