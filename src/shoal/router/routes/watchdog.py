"""A worker's watchdog: one timer that drops it when its heartbeats stop, or when it is
frozen while it holds jobs (``dispatch/stall.py``).

A heartbeat touches nothing here: it moves ``last_seen``, and the timer, set for the
deadline as it stood, finds the deadline moved when it fires and sets itself for the new
one. An idle worker so costs one wake-up every ``--heartbeat-misses`` - 1 of its intervals or
so, whatever the size of the fleet, and a heartbeat O(1). A job placed on it (``on_hold``)
brings the timer forward to the stall timeout from then: the stall clock starts at the
placement, not at the last heartbeat (an idle worker's may be its whole idle interval ago).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from shoal.router.dispatch.stall import frozen, next_check
from shoal.router.dispatch.workers import WorkerConnection

log = logging.getLogger(__name__)


class HeartbeatMissed(Exception):
    pass


class Stalled(Exception):
    """The worker holds jobs and went silent while others were heard from (``stall``)."""


class Watchdog:
    """Watches one worker from ``start()`` until ``stop()``; ``tripped`` fails with
    ``HeartbeatMissed`` or ``Stalled`` when it should be dropped."""

    def __init__(
        self,
        worker: WorkerConnection,
        *,
        misses: int,
        stall_timeout: float,
        others: Callable[[], Iterable[float]],
    ) -> None:
        """``others``: when each other worker was last heard from (read lazily, only for a
        worker that holds jobs and was silent for the stall timeout)."""
        self.worker = worker
        self.misses = misses
        self.stall_timeout = stall_timeout
        self.others = others
        self._loop = asyncio.get_running_loop()
        self.tripped: asyncio.Future[None] = self._loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        self.worker.on_hold = self._on_hold
        self._check()

    def stop(self) -> None:
        self.worker.on_hold = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def deadline(self) -> float:
        """When the worker is lost unless heard from (its own interval, ``misses`` times)."""
        return self.worker.last_seen + self.worker.miss_interval * self.misses

    def _since(self) -> float:
        """Silent since: its last frame, or the placement of its latest job if later."""
        return max(self.worker.last_seen, self.worker.held_since)

    def _arm(self, due: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._due = due
        self._timer = self._loop.call_later(max(0.0, due - time.monotonic()), self._check)

    def _on_hold(self) -> None:
        """A job was placed: look for a stall by the stall timeout from now."""
        if self.stall_timeout > 0 and not self.tripped.done():
            due = time.monotonic() + self.stall_timeout
            if due < self._due:
                self._arm(due)

    def _check(self) -> None:
        self._timer = None
        if self.tripped.done():
            return
        now = time.monotonic()  # as last_seen is (a loop's clock may be another)
        worker = self.worker
        deadline = self.deadline()
        if now >= deadline:
            self.tripped.set_exception(HeartbeatMissed())
            return
        since, holds = self._since(), bool(worker.running)
        if frozen(now, since, holds, self.others(), self.stall_timeout):
            log.warning(
                "worker %s: nothing from it for %.1f s while it holds %d job(s) (%s) and other "
                "workers are heard from: taken for frozen",
                worker.id,
                now - worker.last_seen,
                len(worker.running),
                ", ".join(worker.running),
            )
            self.tripped.set_exception(Stalled())
            return
        due = deadline
        if self.stall_timeout > 0 and holds:
            due = min(due, now + next_check(now, since, self.stall_timeout))
        self._arm(due)
