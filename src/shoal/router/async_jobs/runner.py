"""The ``Runner`` that runs an async job through the dispatcher, like a non-streamed request.

It queues the job, waits for a worker (the dispatcher's ``max_wait`` applies, as for any
request: past it the job fails with the same 503), marks the record running, and returns the
``Result`` body or the ``Failed`` error; past ``--job-timeout`` it fails with a 504. However
it ends (answer, error, timeout, cancel, shutdown), the dispatcher job is cancelled in
``finally``, which is a no-op once it has ended and otherwise frees the queue slot or stops
the worker's generation.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from shoal.jobs.events import Data, Done, Failed, Requeued, Result
from shoal.protocol.ids import ModelName
from shoal.protocol.images import COMPLETED_TYPE, PROGRESS_TYPE
from shoal.router.async_jobs.service import (
    RunFailed,
    Runner,
    RunOutcome,
    RunRequest,
    RunSucceeded,
)
from shoal.router.dispatch.fair_queue import Priority, Tenant
from shoal.router.dispatch.interface import Dispatcher
from shoal.router.dispatch.job import Job, Submission
from shoal.router.errors import JobTimedOut, RouterError, UpstreamError, WorkerLost

log = logging.getLogger(__name__)


def dispatcher_runner(dispatcher: Dispatcher, job_timeout: float = 0.0) -> Runner:
    """``job_timeout``: seconds from submission after which the job fails (``--job-timeout``;
    0: never)."""

    async def run(request: RunRequest) -> RunOutcome:
        streamed = request.endpoint.is_image  # streamed for its progress events
        # Async jobs queue as batch work (after the interactive requests waiting, until aged),
        # with their key's weight and cap.
        q = request.queueing
        owner = Tenant(request.key_id or "async", q.weight, Priority.BATCH, q.max_queued)
        job = dispatcher.submit(
            Submission(
                ModelName(request.model),
                request.endpoint,
                streamed,
                request.body,
                owner,
                key_id=request.key_id,
            )
        )
        log.info("async job %s runs as job %s", request.job_id, job.id)
        limit = asyncio.timeout(job_timeout or None)
        try:
            async with limit:
                return await _outcome(dispatcher, job, request)
        except TimeoutError:
            if not limit.expired():
                raise
            log.warning(
                "async job %s (job %s model=%s): stopped after %g s (--job-timeout)",
                request.job_id,
                job.id,
                job.model,
                job_timeout,
            )
            return RunFailed.of(JobTimedOut(job_timeout))
        finally:
            dispatcher.cancel(job, f"async job {request.job_id} cancelled, stopped or timed out")

    return run


async def _outcome(dispatcher: Dispatcher, job: Job, request: RunRequest) -> RunOutcome:
    positions = dispatcher.queue_positions(job)
    if positions is not None and request.queued is not None:
        async for place in positions:
            await request.queued(place)
    await dispatcher.wait_assigned(job)
    await request.started()
    if request.endpoint.is_image:
        return await _image_answer(dispatcher, job, request)
    return await _answer(dispatcher, job)


async def _answer(dispatcher: Dispatcher, job: Job) -> RunOutcome:
    while True:
        event = await job.events.get()
        match event:
            case Requeued():
                await dispatcher.wait_assigned(job)
            case Result(body=body):
                return _succeeded(job, body)
            case Failed(status=status, error=error):
                return RunFailed.of(UpstreamError(status, error))
            case Data() | Done():
                return RunFailed.of(_unexpected(job, "streamed chunks"))


async def _image_answer(dispatcher: Dispatcher, job: Job, request: RunRequest) -> RunOutcome:
    """An image job's progress events go to the record; its last event is the result."""
    result: dict[str, Any] | None = None
    while True:
        event = await job.events.get()
        match event:
            case Requeued():
                await dispatcher.wait_assigned(job)
            case Data(data=data):
                chunk = orjson.loads(data)
                if chunk.get("type") == PROGRESS_TYPE and request.progress is not None:
                    await request.progress({k: v for k, v in chunk.items() if k != "type"})
                elif chunk.get("type") == COMPLETED_TYPE:
                    result = {k: v for k, v in chunk.items() if k != "type"}
            case Done() if result is not None:
                return RunSucceeded(result)
            case Failed(status=status, error=error):
                return RunFailed.of(UpstreamError(status, error))
            case Done() | Result():
                return RunFailed.of(_unexpected(job, "an image answer without its result"))


def _succeeded(job: Job, body: str) -> RunOutcome:
    try:
        result: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        result = None
    if not isinstance(result, dict):
        return RunFailed.of(_unexpected(job, "an answer that is not a JSON object"))
    return RunSucceeded(result)


def _unexpected(job: Job, what: str) -> RouterError:
    log.warning("job %s model=%s: worker %s sent %s", job.id, job.model, job.worker_id, what)
    return WorkerLost(
        f"The worker sent {what} for this job, which it cannot use; submit it again.",
        code="bad_worker_answer",
    )
