"""Frames waiting for one worker's writer (``routes/worker_socket._write``).

Producers (placement, cancels, the heartbeat pace) append without awaiting; the writer takes
whatever has gathered in one go. A deque and one waiter, instead of ``asyncio.Queue``: no
future per frame (a ``Queue.get`` makes one each time it waits), and a burst (every worker
told a new heartbeat interval, a job and its cancel) is sent in one wake-up.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Outbox:
    def __init__(self) -> None:
        self._frames: deque[str] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, frame: str) -> None:
        self._frames.append(frame)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[str]:
        """Every frame waiting, oldest first, once there is one."""
        await self._until_any()
        frames = list(self._frames)
        self._frames.clear()
        return frames

    async def get(self) -> str:
        """The oldest frame, once there is one (for tests that read what a socketless worker
        is sent, one frame at a time)."""
        await self._until_any()
        return self._frames.popleft()

    def get_nowait(self) -> str:
        if not self._frames:
            raise asyncio.QueueEmpty
        return self._frames.popleft()

    async def _until_any(self) -> None:
        while not self._frames:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def empty(self) -> bool:
        return not self._frames

    def __len__(self) -> int:
        return len(self._frames)
