"""A waiting job's place in its queue, as a waiting stream hears it (``: queued position=N``).

Both dispatchers report places the same way; only where a place comes from differs (the
in-process ``FairQueue``, or the snapshot the Redis dispatcher reads in one script call).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from shoal.router.dispatch.job import Job, JobState

QUEUE_REPORT_S = 2.0
"""A waiting stream hears its place at least this often, and whenever it changes."""


async def report(
    job: Job,
    deadline: float,
    place: Callable[[float], int | None],
    moved: Callable[[], asyncio.Event],
    expire: Callable[[], Awaitable[None]],
) -> AsyncIterator[int]:
    """``job``'s place while it waits: at once, when it changes (``moved()`` is the event set
    at the next change) and every ``QUEUE_REPORT_S``. ``place(now)`` is None while unknown.
    Past ``deadline`` (monotonic) ``expire()`` runs: it withdraws the job and raises."""
    last: int | None = None
    reported = 0.0
    while job.state is JobState.QUEUED:
        now = time.monotonic()
        here = place(now)
        if here is not None and (here != last or now - reported >= QUEUE_REPORT_S):
            yield here
            last, reported = here, time.monotonic()
        if now >= deadline:
            await expire()
            return
        changed = moved()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(QUEUE_REPORT_S, deadline - now)):
                await changed.wait()
