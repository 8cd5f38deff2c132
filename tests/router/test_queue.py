from __future__ import annotations

from dataclasses import dataclass

import pytest

from shoal.queue.memory import MemoryQueue, QueueFullError


@dataclass(eq=False)
class J:
    id: str
    model: str


def test_fifo_per_key_with_bound_and_requeue_at_front() -> None:
    q: MemoryQueue[J] = MemoryQueue(limit=2, key=lambda j: j.model)
    a, b, c = (J(x, "m") for x in "abc")
    other = J("o", "n")
    q.push(a)
    q.push(b)
    q.push(other)  # another key has its own bound
    with pytest.raises(QueueFullError):
        q.push(c)
    assert q.pop("m") is a
    q.push_front(a)  # a job whose worker was lost goes back first
    assert q.jobs("m") == (a, b)
    assert q.remove(b) and not q.remove(b)
    assert q.depth("m") == 1 and sorted(q.waiting_keys()) == ["m", "n"]
