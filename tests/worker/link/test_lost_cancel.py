"""A stop request that Python 3.11's TaskGroup drops is still honoured by the router link.

The race, as a worker's teardown meets it: the drain ends (its task raises, so the worker's
task group cancels the link's task) at the moment the router closes the connection (a child
of the link's own task group fails). On 3.11 the inner group raises the child's error and the
cancellation is lost; the link went on dialing a router that had gone.
"""

from __future__ import annotations

import asyncio
import time

from shoal.worker.link.router_link import _honour_lost_cancel


class Drained(Exception):
    pass


class Closed(Exception):
    pass


async def _link_like(closed: asyncio.Event, after_session: list[str]) -> None:
    """The link's loop in miniature: a session whose reader fails when the router closes,
    then the check, then the wait before dialing again."""
    while True:
        try:
            async with asyncio.TaskGroup() as tg:

                async def reader() -> None:
                    await closed.wait()
                    raise Closed

                tg.create_task(reader())
                await asyncio.sleep(60)
        except* Closed:
            pass
        after_session.append("session ended")
        _honour_lost_cancel()
        await asyncio.sleep(60)  # "reconnecting in ..."


async def _stop_as_the_router_closes() -> tuple[float, list[str]]:
    closed = asyncio.Event()
    after_session: list[str] = []

    async def drain() -> None:
        await closed.wait()
        raise Drained

    async def close_soon() -> None:
        await asyncio.sleep(0.05)
        closed.set()

    started = time.monotonic()
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(drain())
            tg.create_task(close_soon())
            await _link_like(closed, after_session)
    except* Drained:
        pass
    return time.monotonic() - started, after_session


async def _within(seconds: float) -> tuple[float, list[str]] | None:
    try:
        async with asyncio.timeout(seconds):
            return await _stop_as_the_router_closes()
    except TimeoutError:
        return None


def test_the_link_stops_when_its_cancellation_meets_a_closing_router() -> None:
    stopped = asyncio.run(_within(5))
    assert stopped is not None, "the link went on dialing after it was told to stop"
    took, after_session = stopped
    assert took < 5 and after_session == ["session ended"]
