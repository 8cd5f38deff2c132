"""The worker's heartbeats to its router, at the pace the router sets.

The router tells a worker the base interval when it registers (``Registered``) and a longer
one for idle workers when its fleet grows (``HeartbeatInterval``: the router caps the
heartbeats its idle workers send, ``router/dispatch/heartbeats.py``). While the worker runs
a job it beats at the base interval whatever it was told: the router's stall rule and the
queue's leases count on it. A job that starts, or an interval that changes, wakes the loop,
so the next beat is due at the last one plus the interval that applies now.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from shoal.protocol.messages import Heartbeat


class Heartbeats:
    """One connection's heartbeats: ``run()`` sends them until cancelled."""

    def __init__(
        self,
        base: float,
        beat: Callable[[], Awaitable[Heartbeat]],
        send: Callable[[Heartbeat], None],
        busy: Callable[[], bool],
    ) -> None:
        """``base``: the interval from ``Registered``; ``beat`` reads the machine into a
        heartbeat; ``send`` queues it; ``busy``: the worker runs a job now."""
        self.base = base
        self.idle = base
        """The interval while idle (``HeartbeatInterval``; the base until told otherwise)."""
        self._beat = beat
        self._send = send
        self._busy = busy
        self._wake = asyncio.Event()

    def interval(self) -> float:
        """The interval that applies now."""
        return self.base if self._busy() else max(self.base, self.idle)

    def set_idle(self, seconds: float) -> None:
        """The router's ``HeartbeatInterval``."""
        self.idle = seconds
        self._wake.set()

    def poke(self) -> None:
        """A job started: beat at the base interval from the last beat."""
        self._wake.set()

    async def run(self) -> None:
        last = time.monotonic()
        while True:
            self._wake.clear()
            delay = last + self.interval() - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
                    continue  # woken: the interval may be another now
            last = time.monotonic()
            self._send(await self._beat())
