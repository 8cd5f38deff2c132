"""How often idle workers heartbeat for a fleet's size (``router/dispatch/heartbeats.py``)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.protocol.messages import HeartbeatInterval, decode_router_message
from shoal.router.dispatch.heartbeats import (
    MAX_DOUBLINGS,
    SHRINK_BELOW,
    fleet_interval,
    idle_rate,
    needed_interval,
)
from shoal.router.dispatch.workers import WorkerConnection
from shoal.router.settings import RouterSettings
from socketless import memory_dispatcher, worker_connection


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        (0, 5.0),
        (1, 5.0),
        (1250, 5.0),
        (1251, 10.0),
        (2500, 10.0),
        (2501, 20.0),
        (5000, 20.0),
        (10_000, 40.0),
        (10_001, 80.0),
        (20_000, 80.0),
        (10**9, 5.0 * 2**MAX_DOUBLINGS),
    ],
)
def test_needed_interval_doubles_from_the_base(workers: int, expected: float) -> None:
    assert needed_interval(workers, 5.0, 250.0) == expected


@pytest.mark.parametrize(
    ("workers", "current", "expected"),
    [
        (100, None, 5.0),
        (3000, None, 20.0),
        (3000, 10.0, 20.0),  # grows at once
        (2400, 20.0, 20.0),  # 2,400 fit 10 s, but not within SHRINK_BELOW of the budget
        (1875, 20.0, 10.0),  # 1,875 / 0.75 = 2,500: 10 s keeps them within it
        (900, 20.0, 5.0),  # 900 / 0.75 = 1,200: back to the base
        (1000, 20.0, 10.0),  # 1,000 / 0.75 = 1,334 needs 10 s: halfway down
    ],
)
def test_fleet_interval_grows_at_once_and_shrinks_with_a_margin(
    workers: int, current: float | None, expected: float
) -> None:
    assert fleet_interval(workers, 5.0, 250.0, current) == expected


@given(
    workers=st.integers(0, 200_000),
    base=st.sampled_from([0.5, 1.0, 5.0, 7.5]),
    rate=st.floats(0.5, 5000),
)
def test_the_budget_holds_and_the_interval_is_the_shortest_step(
    workers: int, base: float, rate: float
) -> None:
    interval = needed_interval(workers, base, rate)
    steps = interval / base
    assert steps == 2 ** round(math.log2(steps))  # a power of two
    if steps < 2**MAX_DOUBLINGS:
        assert idle_rate(workers, interval) <= rate
    if steps > 1:  # the step below would break the budget
        assert idle_rate(workers, interval / 2) > rate


@given(
    workers=st.integers(0, 100_000),
    current=st.sampled_from([5.0, 10.0, 20.0, 40.0, 80.0]),
    rate=st.floats(1, 1000),
)
def test_a_fleet_interval_never_breaks_the_budget_and_shrinks_with_margin(
    workers: int, current: float, rate: float
) -> None:
    interval = fleet_interval(workers, 5.0, rate, current)
    assert interval >= needed_interval(workers, 5.0, rate)
    if interval < current:
        assert idle_rate(workers, interval) <= rate * SHRINK_BELOW or interval == 5.0


def told(worker: WorkerConnection) -> list[float]:
    """The intervals the router told ``worker`` (its outbox, drained)."""
    frames = []
    while not worker.outbox.empty():
        frames.append(decode_router_message(worker.outbox.get_nowait()))
    return [f.seconds for f in frames if isinstance(f, HeartbeatInterval)]


def test_a_growing_fleet_is_told_longer_intervals_and_a_shrinking_one_shorter() -> None:
    settings = RouterSettings(heartbeat_interval=1.0, heartbeat_rate=2.0, stall_timeout=0)
    dispatcher = memory_dispatcher(settings)
    workers = [worker_connection(f"w{i}") for i in range(5)]
    for w in workers:
        w.heartbeat_interval = w.miss_interval = 1.0  # what ``Registered`` said
    for w in workers[:2]:
        dispatcher.workers.on_registered(w)
    assert told(workers[0]) == told(workers[1]) == []  # 2 workers, 2 a second: the base
    dispatcher.workers.on_registered(workers[2])
    assert [told(w) for w in workers[:3]] == [[2.0]] * 3  # 3 a second: every 2 s
    dispatcher.workers.on_registered(workers[3])
    dispatcher.workers.on_registered(workers[4])
    assert [told(w) for w in workers] == [[4.0]] * 3 + [[2.0, 4.0], [4.0]]
    assert all(w.miss_interval == 4.0 for w in workers)
    for w in workers[2:]:
        dispatcher.workers.on_lost(w, "test")
    # 3 left: 2 s; 2 left: 2 s still (2 / 0.75 heartbeats a second would break the budget)
    assert [told(w) for w in workers[:2]] == [[2.0]] * 2
    dispatcher.workers.on_lost(workers[1], "test")
    assert told(workers[0]) == [1.0]  # alone: the base again
    assert workers[0].miss_interval == 4.0  # until its next heartbeat (the 1 s is in flight)
