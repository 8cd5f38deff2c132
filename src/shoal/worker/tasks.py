"""A task group held open until cancelled, for tasks started on request: the runner's jobs
(``jobs/runner.py``), the shard host's shards (``shards/host.py``).

Whoever holds it awaits ``hold()`` as one task of the worker's task group; ``start`` then
runs a task in it, which ends when it returns or is cancelled, and with the group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


class HeldGroup:
    def __init__(self, what: str) -> None:
        """``what`` is named when a task is started before ``hold`` or after it ended."""
        self._what = what
        self._group: asyncio.TaskGroup | None = None

    @property
    def open(self) -> bool:
        """Whether ``hold`` runs (tasks can be started)."""
        return self._group is not None

    async def hold(self, on_close: Callable[[], None]) -> None:
        """Hold the group open until cancelled; then ``on_close`` (to cancel what runs, and
        say why) and wait for every task to end."""
        async with asyncio.TaskGroup() as tg:
            self._group = tg
            try:
                await asyncio.Event().wait()
            finally:
                self._group = None
                on_close()

    def start(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` in the group; raises ``RuntimeError`` when it is not held."""
        if self._group is None:
            work.close()
            raise RuntimeError(f"{self._what} is not running")
        return self._group.create_task(work)
