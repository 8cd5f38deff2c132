"""The scaling signals per model (``router/observe/autoscaling.signals``): a table of fleets."""

from __future__ import annotations

from shoal.protocol.ids import ModelName
from shoal.router.observe.autoscaling import ModelSignals, WorkerSlots, signals

A, B = ModelName("a"), ModelName("b")


def test_slots_are_ready_only_on_workers_that_take_jobs_and_busy_on_all() -> None:
    workers = [
        WorkerSlots(models=(A,), slots=4, running=1, takes_jobs=True),
        WorkerSlots(models=(A,), slots=2, running=2, takes_jobs=True),
        WorkerSlots(models=(A,), slots=4, running=1, takes_jobs=False, draining=True),
        WorkerSlots(models=(A, B), slots=2, running=0, takes_jobs=False),  # loading
        WorkerSlots(models=(B,), slots=1, running=3, takes_jobs=True),  # over: none free
    ]
    got = signals(workers, {A: 5}, {A: 2.5, B: 1.0})
    assert got[A] == ModelSignals(
        queue_depth=5,
        oldest_wait_s=2.5,
        ready_slots=3,
        busy_slots=4,
        workers=4,
        draining_workers=1,
    )
    # B has nothing waiting: a stale oldest wait is not reported.
    assert got[B] == ModelSignals(busy_slots=3, workers=2)


def test_a_model_nobody_serves_yet_still_shows_its_queue() -> None:
    got = signals([], {A: 2}, {A: 7.25})
    assert got == {A: ModelSignals(queue_depth=2, oldest_wait_s=7.25)}
    assert got[A].as_json()["oldest_wait_s"] == 7.25
