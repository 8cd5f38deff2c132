"""The outbox's journals: a job's output survives a lost router connection, exactly once."""

from __future__ import annotations

import asyncio

from shoal.protocol.ids import JobId
from shoal.protocol.messages import Chunks, JobDone, RunningJob, decode_worker_message
from shoal.worker.link.outbox import Outbox

A, B = JobId("a"), JobId("b")


async def drain(box: Outbox) -> list[tuple[str, str]]:
    """Run the pump until it has sent everything pending: (job id, chunk or message type)."""
    sent: list[tuple[str, str]] = []

    async def send(frame: str | bytes) -> None:
        msg = decode_worker_message(frame)
        if isinstance(msg, Chunks):
            sent.extend((c.job_id, c.data) for c in msg.items)
        else:
            sent.append((getattr(msg, "job_id", ""), msg.type))

    pump = asyncio.create_task(box.pump(send))
    try:
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    finally:
        pump.cancel()
    return sent


async def test_output_of_a_detached_job_is_held_then_resumed_from_the_routers_count() -> None:
    box = Outbox()
    box.open(A, attempt=1)
    box.chunk(A, "1")
    box.chunk(A, "2")
    assert await drain(box) == [("a", "1"), ("a", "2")]
    box.chunk(A, "3")  # queued, never written: the connection broke
    box.detach()
    box.chunk(A, "4")
    box.send(JobDone(job_id=A))
    assert await drain(box) == []  # held: no router yet
    assert box.held() == (RunningJob(job_id=A, attempt=1),)
    # The new router has chunk 1 only (chunk 2 was written but never reached Redis).
    assert box.resume(A, from_chunk=1)
    assert await drain(box) == [("a", "2"), ("a", "3"), ("a", "4"), ("a", "done")]
    assert box.held() == ()
    assert not box.resume(A, from_chunk=0)  # answered in full: the journal is gone


async def test_a_cancelled_job_is_forgotten_and_other_frames_are_not_journaled() -> None:
    box = Outbox()
    box.open(A, attempt=2)
    box.open(B, attempt=1)
    box.chunk(A, "x")
    box.detach()
    box.chunk(B, "y")
    assert {j.job_id for j in box.held()} == {A, B}
    box.discard(B)
    assert box.held() == (RunningJob(job_id=A, attempt=2),)
    box.chunk(JobId("unknown"), "z")  # a job never opened is sent as it comes
    assert await drain(box) == [("unknown", "z")]
    box.clear()
    assert box.held() == () and await drain(box) == []
