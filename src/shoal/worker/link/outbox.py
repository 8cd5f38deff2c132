"""Frames waiting to go to the router, batched without delay, and each job's journal.

Producers (job tasks, heartbeats) append without awaiting. One writer sends whatever has
piled up since its last send: consecutive chunks travel as one ``Chunks`` frame, so under
load the frame rate stays bounded while a lone chunk still leaves at once.

A job the router started (``open``) keeps a journal: every chunk it produced and its final
message, until that final message was written to the router's socket. When the connection
breaks (``detach``) nothing is lost that the router may not have seen: the jobs go on, their
output is held, and the next router either resumes each job from the chunk the client last
got (``resume``) or cancels it (``discard``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from shoal.protocol.ids import JobId
from shoal.protocol.messages import (
    ChunkItem,
    JobDone,
    JobFailed,
    JobResult,
    Message,
    RunningJob,
    encode,
    encode_chunks,
)

MAX_CHUNKS_PER_FRAME = 512

Final = JobDone | JobResult | JobFailed
Pending = Message | ChunkItem
Frame = str | bytes


@dataclass(slots=True)
class Journal:
    """One job's output so far, kept until its final message reached the socket."""

    attempt: int
    chunks: list[ChunkItem] = field(default_factory=list)
    final: Final | None = None
    held: bool = False  # the router that started it is gone: output waits for ``resume``


class Outbox:
    def __init__(self) -> None:
        self._pending: list[Pending] = []
        self._wake = asyncio.Event()
        self._journals: dict[JobId, Journal] = {}
        self._answered = asyncio.Event()
        """Set while no job's answer waits to reach the router (no journal)."""
        self._answered.set()

    # ------------------------------------------------------------ producers

    def send(self, message: Message) -> None:
        if isinstance(message, Final):
            journal = self._journals.get(message.job_id)
            if journal is not None:
                journal.final = message
                if journal.held:
                    return
        self._pending.append(message)
        self._wake.set()

    def chunk(self, job_id: JobId, data: str, tokens: tuple[int, ...] | None = None) -> None:
        item = (job_id, data, tokens)
        journal = self._journals.get(job_id)
        if journal is not None:
            journal.chunks.append(item)
            if journal.held:
                return
        self._pending.append(item)
        self._wake.set()

    # ------------------------------------------------------------ journals

    def open(self, job_id: JobId, attempt: int) -> None:
        """Start journaling a job the router just started."""
        self._journals[job_id] = Journal(attempt)
        self._answered.clear()

    def discard(self, job_id: JobId) -> None:
        """Forget a job (cancelled): its held output is dropped."""
        self._journals.pop(job_id, None)
        self._note_answered()

    def detach(self) -> None:
        """The router connection broke: hold every journaled job's output, drop the rest.

        Frames in flight are dropped too; the journals can send their chunks again.
        """
        self._pending.clear()
        for journal in self._journals.values():
            journal.held = True

    def held(self) -> tuple[RunningJob, ...]:
        """The jobs whose output waits for a router (``Register.running``)."""
        return tuple(
            RunningJob(job_id=job_id, attempt=j.attempt)
            for job_id, j in self._journals.items()
            if j.held
        )

    def resume(self, job_id: JobId, from_chunk: int) -> bool:
        """Send a held job's chunks from ``from_chunk`` on, then go on live; False if unknown."""
        journal = self._journals.get(job_id)
        if journal is None or not journal.held:
            return False
        journal.held = False
        self._pending += journal.chunks[from_chunk:]
        if journal.final is not None:
            self._pending.append(journal.final)
        self._wake.set()
        return True

    def clear(self) -> None:
        """Drop every frame and journal (the worker gave up on its jobs)."""
        self._pending.clear()
        self._journals.clear()
        self._note_answered()

    def _note_answered(self) -> None:
        if not self._journals:
            self._answered.set()

    async def until_answered(self) -> None:
        """Until every job the router started here has had its final message written to the
        router's socket (a draining worker's last wait)."""
        await self._answered.wait()

    # ------------------------------------------------------------ writer

    async def pump(self, send: Callable[[Frame], Awaitable[None]]) -> None:
        """Send frames forever (until cancelled), preserving order."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, []
            for frame in frames(pending):
                await send(frame)
            for item in pending:  # answered in full: the journal is no longer needed
                if isinstance(item, Final):
                    self._journals.pop(item.job_id, None)
            self._note_answered()


def frames(pending: list[Pending]) -> list[Frame]:
    out: list[Frame] = []
    batch: list[ChunkItem] = []
    for item in pending:
        if isinstance(item, tuple):
            batch.append(item)
            if len(batch) >= MAX_CHUNKS_PER_FRAME:
                out.append(encode_chunks(batch))
                batch = []
            continue
        if batch:
            out.append(encode_chunks(batch))
            batch = []
        out.append(encode(item))
    if batch:
        out.append(encode_chunks(batch))
    return out
