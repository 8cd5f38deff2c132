"""A worker's heartbeats at the router's pace (``worker/link/heartbeats.py``): real timers."""

from __future__ import annotations

import asyncio
import time

from shoal.protocol.messages import BackendState, Heartbeat
from shoal.worker.link.heartbeats import Heartbeats

BASE = 0.1


class Beats:
    """Where the heartbeats go: when each was sent."""

    def __init__(self) -> None:
        self.at: list[float] = []
        self.busy = False

    async def beat(self) -> Heartbeat:
        return Heartbeat(state=BackendState.READY, running_jobs=0, ram_available_bytes=1)

    def send(self, _beat: Heartbeat) -> None:
        self.at.append(time.monotonic())

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.at, self.at[1:], strict=False)]


async def test_an_idle_worker_beats_at_the_interval_it_was_told() -> None:
    beats = Beats()
    pace = Heartbeats(BASE, beats.beat, beats.send, busy=lambda: beats.busy)
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(pace.run())
        await asyncio.sleep(BASE * 4.5)
        fast = len(beats.at)
        pace.set_idle(BASE * 4)
        beats.at.clear()
        await asyncio.sleep(BASE * 8.5)
        task.cancel()
    assert fast >= 3
    assert 1 <= len(beats.at) <= 3
    assert all(g >= BASE * 3.9 for g in beats.gaps())


async def test_a_busy_worker_beats_at_the_base_interval_whatever_it_was_told() -> None:
    beats = Beats()
    pace = Heartbeats(BASE, beats.beat, beats.send, busy=lambda: beats.busy)
    pace.set_idle(BASE * 100)
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(pace.run())
        await asyncio.sleep(BASE * 2)
        assert beats.at == []  # idle: the long interval
        beats.busy = True
        pace.poke()  # a job started
        await asyncio.sleep(BASE * 4.5)
        task.cancel()
    assert len(beats.at) >= 3
    assert pace.interval() == BASE


async def test_the_interval_never_goes_below_the_base() -> None:
    beats = Beats()
    pace = Heartbeats(BASE, beats.beat, beats.send, busy=lambda: beats.busy)
    pace.set_idle(BASE / 10)
    assert pace.interval() == BASE
