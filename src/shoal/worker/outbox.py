"""Frames waiting to go to the router, batched without delay.

Producers (job tasks, heartbeats) append without awaiting. One writer sends whatever has
piled up since its last send: consecutive chunks travel as one ``Chunks`` frame, so under
load the frame rate stays bounded while a lone chunk still leaves at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from shoal.protocol.ids import JobId
from shoal.protocol.messages import Message, encode, encode_chunks

MAX_CHUNKS_PER_FRAME = 512

Pending = Message | tuple[JobId, str]
Frame = str | bytes


class Outbox:
    def __init__(self) -> None:
        self._pending: list[Pending] = []
        self._wake = asyncio.Event()

    def send(self, message: Message) -> None:
        self._pending.append(message)
        self._wake.set()

    def chunk(self, job_id: JobId, data: str) -> None:
        self._pending.append((job_id, data))
        self._wake.set()

    def clear(self) -> None:
        self._pending.clear()

    async def pump(self, send: Callable[[Frame], Awaitable[None]]) -> None:
        """Send frames forever (until cancelled), preserving order."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, []
            for frame in frames(pending):
                await send(frame)


def frames(pending: list[Pending]) -> list[Frame]:
    out: list[Frame] = []
    batch: list[tuple[JobId, str]] = []
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
