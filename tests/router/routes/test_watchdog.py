"""A worker's watchdog (``router/routes/watchdog.py``): one timer, real time, no sockets."""

from __future__ import annotations

import asyncio
import time

import pytest

from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import Endpoint
from shoal.router.dispatch.job import Job, Submission
from shoal.router.dispatch.workers import WorkerConnection
from shoal.router.routes.watchdog import HeartbeatMissed, Stalled, Watchdog
from socketless import worker_connection

INTERVAL = 0.1


def watched(worker: WorkerConnection, *, stall: float = 0.0, others: float = 0.0) -> Watchdog:
    """``others``: how long ago another worker was heard from (0: just now, always)."""
    worker.heartbeat_interval = worker.miss_interval = INTERVAL
    dog = Watchdog(
        worker, misses=3, stall_timeout=stall, others=lambda: [time.monotonic() - others]
    )
    dog.start()
    return dog


async def test_a_silent_worker_is_lost_after_its_misses() -> None:
    worker = worker_connection("w")
    worker.last_seen = time.monotonic()
    dog = watched(worker)
    started = time.monotonic()
    with pytest.raises(HeartbeatMissed):
        await dog.tripped
    assert time.monotonic() - started >= INTERVAL * 3 * 0.95
    dog.stop()


async def test_heartbeats_keep_it_without_waking_the_watchdog_each_time() -> None:
    worker = worker_connection("w")
    dog = watched(worker)
    for _ in range(8):
        await asyncio.sleep(INTERVAL)
        worker.last_seen = time.monotonic()  # a heartbeat: nothing else
    assert not dog.tripped.done()
    dog.stop()


async def test_the_miss_timeout_follows_the_workers_own_interval() -> None:
    worker = worker_connection("w")
    dog = watched(worker)
    worker.pace(INTERVAL * 4)  # told to beat less often: 3 misses are 1.2 s now
    await asyncio.sleep(INTERVAL * 5)
    assert not dog.tripped.done()
    with pytest.raises(HeartbeatMissed):
        await dog.tripped
    dog.stop()


async def test_the_stall_clock_starts_at_placement_not_at_the_last_heartbeat() -> None:
    worker = worker_connection("w")
    dog = watched(worker, stall=0.3)
    worker.miss_interval = worker.heartbeat_interval = INTERVAL * 20  # a slow idle pace
    worker.last_seen = time.monotonic() - 1.0  # heard from a second ago, within its interval
    job = Job.of(Submission(ModelName("m"), Endpoint.CHAT, True, {"messages": []}))
    worker.hold(JobId("j"), job)
    await asyncio.sleep(0.15)
    assert not dog.tripped.done()  # not taken for frozen at once
    with pytest.raises(Stalled):
        await dog.tripped  # silent for the stall timeout since the placement
    dog.stop()
