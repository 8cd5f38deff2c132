"""The one interface of the job path: what routes and the composition root may ask of it.

Two siblings implement it, chosen once in ``router/app.py``: ``MemoryDispatcher`` (jobs wait
in this router) and ``RedisDispatcher`` (jobs wait in Redis, shared by every router on it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from shoal.protocol.ids import ModelName
from shoal.protocol.messages import Endpoint
from shoal.router.dispatch.directory import RemoteWorker
from shoal.router.dispatch.job import Job, Submission
from shoal.router.dispatch.worker_side import WorkerSide


class Dispatcher(Protocol):
    @property
    def queue_backend(self) -> str:
        """Where jobs wait: ``memory`` (this router only) or ``redis`` (shared by its routers)."""
        ...

    @property
    def workers(self) -> WorkerSide:
        """Where this router's workers' frames go (``routes/worker_socket.py``)."""
        ...

    # ------------------------------------------------------------ a request's side

    def check_served(self, model: ModelName, endpoint: Endpoint) -> None:
        """404/400/503 when no worker anywhere could take a job for ``model`` at ``endpoint``
        now (``submit`` checks it first; async jobs are checked before they are accepted)."""
        ...

    def submit(self, ask: Submission) -> Job:
        """Accept a job (404/400/503/429 when no worker anywhere could take it)."""
        ...

    async def wait_assigned(self, job: Job) -> None:
        """Until a worker takes the job; past ``--max-wait``, a 503 (the job withdrawn)."""
        ...

    def cancel(self, job: Job, why: str) -> None:
        """The client went away: drop the job wherever it is and stop its generation."""
        ...

    def queue_positions(self, job: Job) -> AsyncIterator[int] | None:
        """While ``job`` waits: how many jobs will go before it, at once, whenever that
        changes and at least every 2 s; it ends when a worker takes the job and raises the
        503 of ``wait_assigned`` past ``--max-wait`` (and, with Redis, the enqueue's refusal,
        a 429, before its first place). None when the job does not wait."""
        ...

    def settle(self, job: Job, tokens: int) -> None:
        """The job ended having used ``tokens`` (prompt and output): correct its tenant's
        share, which was charged its estimate."""
        ...

    # ------------------------------------------------------------ the cluster's view

    def queue_depths(self) -> Mapping[ModelName, int]:
        """Requests waiting for a worker, per model (all its endpoints); a model with none
        may be missing. Cheap: no I/O (with Redis, a snapshot a heartbeat interval old)."""
        ...

    def oldest_waits(self) -> Mapping[ModelName, float]:
        """Seconds the oldest request waiting for each model has waited (since it last started
        to wait); a model with none waiting may be missing. Cheap like ``queue_depths`` (with
        Redis, the same snapshot)."""
        ...

    def waiting_by_key(self) -> Mapping[str, int]:
        """Requests waiting per tenant (API key id): in this router, or with Redis in every
        router on it (a snapshot a heartbeat interval old)."""
        ...

    def remote_workers(self) -> list[RemoteWorker]:
        """Workers connected to other routers (only routers sharing a Redis have any)."""
        ...

    def worker_summaries(self) -> list[dict[str, object]]:
        """Every worker of the cluster, as ``/api/v1/workers`` lists them."""
        ...

    def heard_from_cluster(self) -> float | None:
        """``time.monotonic()`` when this router last heard, through Redis, that another
        router's worker is alive (its last worker-directory sync that found one); None
        without Redis or before that. The stall rule counts it as another worker heard from
        (``router/dispatch/stall.py``)."""
        ...

    # ------------------------------------------------------------ lifetime

    async def run(self) -> None:
        """Background work until cancelled (returns at once when there is none)."""
        ...

    async def close(self) -> None:
        """Release connections, after ``run()`` ended."""
        ...
