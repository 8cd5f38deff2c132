"""The in-process job queue: one bounded FIFO per key (the router keys by model and endpoint)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

J = TypeVar("J")


class QueueFullError(Exception):
    pass


class MemoryQueue(Generic[J]):
    """FIFO per ``key(job)``. ``push`` refuses past ``limit`` waiting jobs with that key."""

    def __init__(self, limit: int, key: Callable[[J], Hashable]) -> None:
        self.limit = limit
        self._key = key
        self._queues: dict[Hashable, deque[J]] = {}

    def push(self, job: J) -> None:
        q = self._queues.setdefault(self._key(job), deque())
        if len(q) >= self.limit:
            raise QueueFullError(self._key(job))
        q.append(job)

    def push_front(self, job: J) -> None:
        """Put back a job that lost its worker: it keeps its place ahead of newer ones."""
        self._queues.setdefault(self._key(job), deque()).appendleft(job)

    def peek(self, key: Hashable) -> J | None:
        q = self._queues.get(key)
        return q[0] if q else None

    def pop(self, key: Hashable) -> J:
        return self._queues[key].popleft()

    def remove(self, job: J) -> bool:
        q = self._queues.get(self._key(job))
        if q is None:
            return False
        try:
            q.remove(job)
        except ValueError:
            return False
        return True

    def depth(self, key: Hashable) -> int:
        q = self._queues.get(key)
        return len(q) if q else 0

    def waiting_keys(self) -> Iterator[Hashable]:
        """Keys with waiting jobs (a snapshot: safe to push and pop while iterating)."""
        return iter([k for k, q in self._queues.items() if q])

    def jobs(self, key: Hashable) -> tuple[J, ...]:
        return tuple(self._queues.get(key, ()))
