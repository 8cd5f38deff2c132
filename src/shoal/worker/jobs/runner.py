"""The worker's running jobs: one task each, inside one task group, cancellable by id.

Text jobs run on the worker's backend (``text/backend.py``: llama-server or an attached
server), or on the one ``route`` names for their model; image jobs on the function ``serve``
gives for the image endpoints (``ImageModels.run_job``). The runner knows each only as a
``JobFunction``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager

from shoal.protocol.ids import JobId
from shoal.protocol.messages import Endpoint, ErrorBody, JobFailed, JobStart
from shoal.worker.jobs.sink import JobSink
from shoal.worker.lifecycle import NotServing
from shoal.worker.tasks import HeldGroup

Gate = Callable[[], AbstractAsyncContextManager[None]]
"""Holds the backend for one job (``LlamaServer.use``: loads it first if it was unloaded)."""

log = logging.getLogger(__name__)


JobFunction = Callable[[JobStart, JobSink], Awaitable[None]]
"""Runs one job and reports every outcome through the sink; cancel it to stop the job."""


class JobRunner:
    def __init__(self, outbox: JobSink) -> None:
        self.outbox = outbox
        self.backend: JobFunction | None = None
        """Runs text jobs (``Backend.run``)."""
        self.gate: Gate = contextlib.nullcontext
        self._routes: dict[str, tuple[JobFunction, Gate]] = {}
        self._images: dict[Endpoint, JobFunction] = {}
        self._tasks: dict[JobId, asyncio.Task[None]] = {}
        self._held = HeldGroup("job runner")
        self._idle = asyncio.Event()
        """Set while no job runs."""
        self._idle.set()

    @property
    def running(self) -> int:
        return len(self._tasks)

    async def until_idle(self) -> None:
        """Until no job runs here."""
        await self._idle.wait()

    def serve(self, endpoints: Iterable[Endpoint], run: JobFunction) -> None:
        """Run jobs for the image ``endpoints`` with ``run`` (which holds its own models)."""
        for endpoint in endpoints:
            self._images[endpoint] = run

    async def run(self, backend: JobFunction | None = None, gate: Gate | None = None) -> None:
        """Own the task group jobs run in, until cancelled. ``backend`` runs text jobs (a
        worker with only an image model has none)."""
        if backend is not None:
            self.backend = backend
            self.gate = gate or contextlib.nullcontext
        await self._held.hold(lambda: self.cancel_all("worker stopping"))

    def route(self, model: str, backend: JobFunction, gate: Gate) -> None:
        """Send jobs for ``model`` to ``backend`` (a split model this worker is the head of)."""
        self._routes[model] = (backend, gate)

    def unroute(self, model: str) -> None:
        self._routes.pop(model, None)

    def start(self, job: JobStart) -> None:
        if not self._held.open:
            raise RuntimeError("job runner is not running")
        if job.endpoint.is_image:
            self._start_image(job)
            return
        backend, gate = self._routes.get(job.model) or (self.backend, self.gate)
        if backend is None:
            raise RuntimeError("job runner has no backend yet")
        log.info(
            "job %s model=%s endpoint=%s stream=%s: started",
            job.job_id,
            job.model,
            job.endpoint.value,
            job.stream,
        )
        task = self._held.start(self._run(job, backend, gate))
        self._tasks[job.job_id] = task
        self._idle.clear()

    def _start_image(self, job: JobStart) -> None:
        run = self._images.get(job.endpoint)
        if run is None:
            log.warning("job %s: this worker does not serve %s", job.job_id, job.endpoint.path)
            error = ErrorBody(
                message=f"This worker does not serve {job.endpoint.path}.",
                type="invalid_request_error",
                code="unsupported_endpoint",
            )
            self.outbox.send(JobFailed(job_id=job.job_id, status=400, error=error))
            return
        log.info("job %s model=%s endpoint=%s: started", job.job_id, job.model, job.endpoint)
        self._tasks[job.job_id] = self._held.start(self._run(job, run))
        self._idle.clear()

    async def _run(
        self, job: JobStart, run: JobFunction, gate: Gate = contextlib.nullcontext
    ) -> None:
        try:
            async with gate():
                await run(job, self.outbox)
            log.info("job %s: finished", job.job_id)
        except NotServing as exc:
            log.warning("job %s: its backend cannot serve it: %s", job.job_id, exc)
            self.outbox.send(
                JobFailed(
                    job_id=job.job_id,
                    status=503,
                    retryable=True,
                    error=ErrorBody(
                        message=f"The worker's backend failed: {exc}",
                        type="server_error",
                        code="backend_failed",
                    ),
                )
            )
        except asyncio.CancelledError:
            log.info("job %s: cancelled, backend request closed", job.job_id)
            raise
        except Exception:  # a bug in one job must not take the worker and its other jobs down
            log.exception("job %s: failed inside the worker", job.job_id)
            self.outbox.send(
                JobFailed(
                    job_id=job.job_id,
                    status=500,
                    error=ErrorBody(
                        message="The worker failed while running this request; see its log.",
                        type="server_error",
                        code="worker_error",
                    ),
                )
            )
        finally:
            self._tasks.pop(job.job_id, None)
            if not self._tasks:
                self._idle.set()

    def cancel(self, job_id: JobId) -> None:
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()

    def cancel_all(self, why: str) -> None:
        if self._tasks:
            log.info("cancelling %d job(s): %s", len(self._tasks), why)
        for task in list(self._tasks.values()):
            task.cancel()
