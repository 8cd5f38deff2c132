"""A worker told to stop (SIGTERM) drains before it stops, so scaling down loses no answer.

``Drain.request`` (the CLI's SIGTERM handler) starts it; ``drain`` (a task of the worker's
composition root) then tells its link to take no new job (a router-link worker sends
``Draining``: the router sends it none; a pull worker stops claiming), waits until every job
it runs has been answered in full (``until_answered``), for at most ``--drain-timeout``
seconds, and raises ``Drained`` to end the worker's task group. Jobs still running then are
left as a lost connection leaves them: the router resumes them on another worker (a pull
worker gives them back to the queue). A second SIGTERM, or SIGINT, stops at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

log = logging.getLogger(__name__)


class Drained(Exception):
    """The drain ended: the worker stops (its composition root catches this)."""


class Drain:
    """The stop request, made outside the worker (a signal handler), awaited inside it."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()

    def request(self) -> bool:
        """Start draining; False when already draining (the caller then stops at once)."""
        if self.requested.is_set():
            return False
        self.requested.set()
        return True


class Drainable(Protocol):
    """A worker's link to its jobs (``RouterLink``, ``RedisPuller``)."""

    def drain(self, timeout_s: float) -> None:
        """Take no new job from now on (and say so to whoever sends them)."""
        ...


async def drain(
    requested: Drain,
    link: Drainable,
    running: Callable[[], int],
    until_answered: Callable[[], Awaitable[None]],
    timeout_s: float,
    worker: str,
) -> None:
    """Once a drain is requested: stop taking jobs, wait for the running ones (at most
    ``timeout_s``), then raise ``Drained``."""
    await requested.requested.wait()
    log.info(
        "worker %s draining: takes no new job, %d running; stops when they are answered or "
        "in %g s (--drain-timeout)",
        worker,
        running(),
        timeout_s,
    )
    link.drain(timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            await until_answered()
        log.info("worker %s drained: every job answered; stopping", worker)
    except TimeoutError:
        log.warning(
            "worker %s: %d job(s) still running after %g s (--drain-timeout); stopping, they "
            "go on on another worker",
            worker,
            running(),
            timeout_s,
        )
    raise Drained
