"""A pull worker's entry in the cluster's worker list, so every router lists it.

Routers on one Redis share their workers through one hash per worker
(``redis_queue.keys.worker_key``: fields ``router``, the router holding it, and ``summary``, the
JSON ``/api/v1/workers`` shows), with a TTL, its id in the ``worker_index_key`` set (see
``shoal.router.dispatch.directory``). A pull worker has no router: it writes its own hash, with
``router`` = ``PULL_HOLDER`` and ``"connection": "redis-pull"`` in the summary, every
``interval_s``, at once after ``changed()`` (state, models), and after ``soon()`` (a job
started or ended, its slots hold something new) at most every ``PUSH_GAP_S``, as routers push
their workers' (``directory.PUSH_GAP_S``); with a TTL of three intervals (a worker that dies
drops out of the list); it deletes it when it stops.

Its summary names the consumer it claims jobs under (``"consumer"``): a router whose
request's prefix this worker's slots hold holds the job for that name in Redis
(``router.dispatch.scheduler.hold_for``, ``redis_queue/claim.py``), as it does for a router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import orjson
import redis.asyncio as aioredis

from shoal.protocol.messages import Register
from shoal.protocol.telemetry import GpuSample
from shoal.redis_queue.keys import worker_index_key, worker_key
from shoal.redis_queue.support import REDIS_DOWN, OutageLog, raise_if_cancelled

log = logging.getLogger(__name__)

PULL_HOLDER = "pull"
"""The ``router`` field of a pull worker's entry: no router holds it (never a router's name,
which always starts with ``router-``)."""
CONNECTION = "redis-pull"
INTERVAL_S = 5.0
PUSH_GAP_S = 0.2
"""The least time between two writes brought on by ``soon()``: what the slots hold and how
busy they are reach the routers promptly, bounded in rate (the routers' own bound)."""
REMOVE_TIMEOUT_S = 2.0
"""How long a stopping worker tries to delete its entry (else it expires with its TTL)."""

Summary = dict[str, object]


def summary(
    reg: Register,
    *,
    detail: str,
    running_jobs: int,
    ram_available_bytes: int,
    gpu_free_bytes: tuple[int | None, ...],
    connected_at: float,
    consumer: str,
    cached_blocks: tuple[int, ...] = (),
    gpu_telemetry: tuple[GpuSample, ...] = (),
    draining: bool = False,
    running_by_model: dict[str, int] | None = None,
) -> Summary:
    """The entry's summary: the fields a router writes for its own workers, and ``consumer``,
    this worker's name in the queue's consumer group (what a job is held for)."""
    return {
        "id": reg.worker_id,
        "name": reg.name,
        "state": reg.state.value,
        "detail": detail,
        "connection": CONNECTION,
        "models": [m.model_dump(mode="json") for m in reg.models],
        "slots": reg.slots,
        "running_jobs": running_jobs,
        "hardware": reg.hardware.model_dump(mode="json"),
        "ram_available_bytes": ram_available_bytes,
        "gpu_free_bytes": list(gpu_free_bytes),
        "gpus_unused": reg.gpus_unused,
        "gpu_telemetry": [g.model_dump(mode="json") for g in gpu_telemetry],
        "backend_url": reg.backend_url,
        "software": reg.software,
        "peer": "",
        "connected_at": connected_at,
        "last_seen_s_ago": 0.0,  # written just now; the TTL drops an entry gone stale
        "cached_blocks": list(cached_blocks),
        "consumer": consumer,
        "draining": draining,
        "model_budget_bytes": reg.model_budget_bytes,
        "running_by_model": running_by_model or {},
    }


class Presence:
    """Keeps this worker's entry in the worker list while ``run()`` runs."""

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        worker_id: str,
        describe: Callable[[], Awaitable[Summary]],
        *,
        interval_s: float = INTERVAL_S,
        outage: OutageLog | None = None,
    ) -> None:
        """``outage`` logs Redis outages (shared with the worker's queue: logged once)."""
        self.key = worker_key(prefix, worker_id)
        self.worker_id = worker_id
        self.listed = False
        self._index = worker_index_key(prefix)
        self._redis = redis
        self._describe = describe
        self._interval_s = interval_s
        self._ttl_ms = int(interval_s * 3000)
        self._changed = asyncio.Event()
        self._now = False  # changed() since the last write, not only soon()
        self._outage = outage or OutageLog()

    def changed(self) -> None:
        """State or models changed: write now rather than at the next interval."""
        self._now = True
        self._changed.set()

    def soon(self) -> None:
        """A job started or ended, or the slots hold something new: write within
        ``PUSH_GAP_S`` of the last write (several changes share one)."""
        self._changed.set()

    async def run(self) -> None:
        try:
            while True:
                self._changed.clear()
                self._now = False
                try:
                    await self.write()
                    self._outage.succeeded()
                except REDIS_DOWN as exc:
                    self._outage.failed("worker list", exc)
                    self.listed = False
                raise_if_cancelled()
                written_at = time.monotonic()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._interval_s):
                        await self._changed.wait()
                gap = written_at + PUSH_GAP_S - time.monotonic()
                if not self._now and gap > 0:
                    await asyncio.sleep(gap)  # the rate bound of soon(): later ones join in
        finally:
            with contextlib.suppress(*REDIS_DOWN, TimeoutError):
                async with asyncio.timeout(REMOVE_TIMEOUT_S):
                    await self.remove()

    async def write(self) -> None:
        entry = await self._describe()
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.key, mapping={"router": PULL_HOLDER, "summary": orjson.dumps(entry)})
            pipe.pexpire(self.key, self._ttl_ms)
            pipe.sadd(self._index, self.worker_id)
            await pipe.execute()
        if not self.listed:
            log.info("worker %s: listed in the worker list (%s)", self.worker_id, self.key)
        self.listed = True

    async def remove(self) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.unlink(self.key)
            pipe.srem(self._index, self.worker_id)
            await pipe.execute()
        self.listed = False
        log.info("worker %s: removed from the cluster's worker list", self.worker_id)
