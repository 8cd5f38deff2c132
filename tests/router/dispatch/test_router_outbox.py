"""Frames waiting for a worker's writer (``router/dispatch/outbox.py``)."""

from __future__ import annotations

import asyncio

import pytest

from shoal.router.dispatch.outbox import Outbox


async def test_the_writer_takes_every_frame_gathered_in_order() -> None:
    box = Outbox()
    taking = asyncio.ensure_future(box.take())
    await asyncio.sleep(0)
    assert not taking.done()  # nothing yet: it waits
    box.put_nowait("a")
    box.put_nowait("b")
    assert await taking == ["a", "b"]
    assert box.empty() and len(box) == 0
    box.put_nowait("c")
    assert await box.take() == ["c"]


async def test_frames_read_one_at_a_time() -> None:
    box = Outbox()
    box.put_nowait("a")
    box.put_nowait("b")
    assert box.get_nowait() == "a"
    assert await box.get() == "b"
    with pytest.raises(asyncio.QueueEmpty):
        box.get_nowait()
    later = asyncio.ensure_future(box.get())
    await asyncio.sleep(0)
    box.put_nowait("c")
    assert await later == "c"
