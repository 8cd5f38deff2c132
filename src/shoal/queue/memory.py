"""The in-process job queue: one bounded FIFO per model."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from shoal.protocol.ids import JobId, ModelName


class Queued(Protocol):
    @property
    def id(self) -> JobId: ...

    @property
    def model(self) -> ModelName: ...


J = TypeVar("J", bound=Queued)


class QueueFullError(Exception):
    pass


class MemoryQueue(Generic[J]):
    """Per-model FIFO. ``push`` refuses past ``limit`` waiting jobs of that model."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._queues: dict[ModelName, deque[J]] = {}

    def push(self, job: J) -> None:
        q = self._queues.setdefault(job.model, deque())
        if len(q) >= self.limit:
            raise QueueFullError(job.model)
        q.append(job)

    def push_front(self, job: J) -> None:
        """Put back a job that lost its worker: it keeps its place ahead of newer ones."""
        self._queues.setdefault(job.model, deque()).appendleft(job)

    def peek(self, model: ModelName) -> J | None:
        q = self._queues.get(model)
        return q[0] if q else None

    def pop(self, model: ModelName) -> J:
        return self._queues[model].popleft()

    def remove(self, job: J) -> bool:
        q = self._queues.get(job.model)
        if q is None:
            return False
        try:
            q.remove(job)
        except ValueError:
            return False
        return True

    def depth(self, model: ModelName) -> int:
        q = self._queues.get(model)
        return len(q) if q else 0

    def models(self) -> Iterator[ModelName]:
        return iter([m for m, q in self._queues.items() if q])

    def jobs(self, model: ModelName) -> tuple[J, ...]:
        return tuple(self._queues.get(model, ()))
