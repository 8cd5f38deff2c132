from __future__ import annotations

from dataclasses import dataclass

import pytest

from shoal.protocol.ids import JobId, ModelName
from shoal.queue.memory import MemoryQueue, QueueFullError


@dataclass(eq=False)
class J:
    id: JobId
    model: ModelName


def test_fifo_per_model_with_bound_and_requeue_at_front() -> None:
    q: MemoryQueue[J] = MemoryQueue(limit=2)
    a, b, c = (J(JobId(x), ModelName("m")) for x in "abc")
    other = J(JobId("o"), ModelName("n"))
    q.push(a)
    q.push(b)
    q.push(other)  # another model has its own bound
    with pytest.raises(QueueFullError):
        q.push(c)
    assert q.pop(ModelName("m")) is a
    q.push_front(a)  # a job whose worker was lost goes back first
    assert q.jobs(ModelName("m")) == (a, b)
    assert q.remove(b) and not q.remove(b)
    assert q.depth(ModelName("m")) == 1 and sorted(q.models()) == ["m", "n"]
