"""Jobs waiting for one (model, endpoint), served fairly between tenants (API keys).

Start-time fair queueing (Goyal et al., SIGCOMM 1996), measured in work, not in requests:

* every job has a *cost* (prompt tokens + expected output) and its tenant a *weight*;
* a job that arrives gets the start tag ``S = max(V, F_tenant)`` and its tenant's finish tag
  becomes ``F_tenant = S + cost / weight``; ``V``, the virtual time, is the start tag of the
  job dispatched last;
* the job with the smallest start tag goes first (ties: the one that arrived first).

So a tenant that floods the queue gets tags far in the future and one that sends a job now and
then finds its tag at ``V``, ahead of the flood. It is work-conserving (a tenant alone takes
every slot) and, over any interval in which tenants i and j both have jobs waiting, the work
dispatched for them obeys ``|W_i / w_i - W_j / w_j| <= c_i / w_i + c_j / w_j`` with ``c`` the
largest cost of each (tested with hypothesis in ``tests/router/dispatch/test_fair_queue.py``).

Two classes: *interactive* jobs go before *batch* ones (async jobs); a batch job that has
waited ``batch_aging_s`` counts as interactive, so batch work is never held back longer than
that by interactive work. A job put back (its worker was lost) goes first within its class.

A tenant may cap its jobs waiting (``Tenant.max_queued``); ``waiting`` counts them for the
caller, which refuses the job past the cap (``memory.py``), in either mode.

``fair=False`` keeps one first-in first-out order over everything (``--scheduling fifo``).
Pure: the caller passes the time; nothing here does I/O.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import orjson

from shoal.keys.records import Priority as Priority  # the classes are the keys' (`--priority`)

J = TypeVar("J", bound=Hashable)

BATCH_AGING_S = 30.0
OUTPUT_GUESS = 256
"""Output tokens expected of a request that sets no ``max_tokens`` (settled when it ends)."""
CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a job is served for: an API key's id (or ``flag``/``anonymous``), its weight, the
    class its jobs queue in, and how many of its jobs may wait (None: no cap of its own)."""

    id: str
    weight: float = 1.0
    priority: Priority = Priority.INTERACTIVE
    max_queued: int | None = None


ANONYMOUS = Tenant("anonymous")
"""Callers without a key of the database (open on loopback, or flag keys): one tenant."""


class QueueFull(Exception):
    pass


def estimated_work(body: dict[str, Any]) -> float:
    """A request's work in tokens before it runs: its prompt (from its length: the router does
    not tokenize) plus the output it asks for. ``settle`` corrects it with the real count."""
    prompt = body.get("messages", body.get("prompt", body.get("input", "")))
    size = len(orjson.dumps(prompt)) if not isinstance(prompt, str) else len(prompt)
    output = OUTPUT_GUESS
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            output = value
            break
    return size / CHARS_PER_TOKEN + output


@dataclass(slots=True)
class _Waiting(Generic[J]):
    job: J
    tenant: Tenant
    cost: float
    start: float
    seq: int
    since: float


class FairQueue(Generic[J]):
    def __init__(
        self, limit: int, *, fair: bool = True, batch_aging_s: float = BATCH_AGING_S
    ) -> None:
        self.limit = limit
        self.fair = fair
        self.batch_aging_s = batch_aging_s
        self._v = 0.0  # virtual time: the start tag of the job dispatched last
        self._finish: dict[str, float] = {}  # tenant id -> finish tag of its last job
        # One FIFO per (tenant, class): within one, start tags rise with arrival, so its head
        # is its next job and the choice looks only at heads.
        self._lanes: dict[tuple[str, Priority], deque[_Waiting[J]]] = {}
        self._where: dict[J, _Waiting[J]] = {}
        self._waiting: Counter[str] = Counter()  # tenant id -> its jobs waiting
        self._seq = itertools.count()
        self._front = itertools.count(-1, -1)  # put-back jobs: ahead of every arrival

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, job: J) -> bool:
        return job in self._where

    def waiting_by_tenant(self) -> Mapping[str, int]:
        """Jobs waiting per tenant id."""
        return dict(self._waiting)

    def jobs(self) -> Iterator[J]:
        return iter(list(self._where))

    def waiting_weights(self) -> dict[str, float]:
        """The weight of each tenant with jobs waiting (their share of the slots)."""
        return {lane[0].tenant.id: lane[0].tenant.weight for lane in self._lanes.values()}

    def waiting(self, tenant_id: str) -> int:
        """How many jobs of this tenant wait here (both classes)."""
        return self._waiting[tenant_id]

    # ------------------------------------------------------------ arrivals

    def push(self, job: J, tenant: Tenant, cost: float, now: float) -> None:
        """Queue ``job``; ``QueueFull`` past ``limit`` waiting jobs."""
        if len(self._where) >= self.limit:
            raise QueueFull
        start = self._tag(tenant, cost)
        self._add(_Waiting(job, tenant, cost, start, next(self._seq), now), front=False)

    def charge(self, tenant: Tenant, cost: float) -> None:
        """A job of ``tenant`` went to a worker without waiting (nothing was queued): it
        counts as pushed and dispatched at once, so its tenant's share knows of it."""
        self._v = max(self._v, self._tag(tenant, cost))

    def _tag(self, tenant: Tenant, cost: float) -> float:
        """The start tag of a job of ``tenant`` arriving now; its finish tag is recorded."""
        start = max(self._v, self._finish.get(tenant.id, self._v))
        self._finish[tenant.id] = start + max(cost, 1.0) / tenant.weight
        return start

    def push_front(self, job: J, tenant: Tenant, cost: float, now: float) -> None:
        """Put back a job that was dispatched and lost its worker: it goes first in its class
        (its tenant was charged for it when it first arrived)."""
        self._add(_Waiting(job, tenant, cost, self._v, next(self._front), now), front=True)

    def _add(self, w: _Waiting[J], *, front: bool) -> None:
        lane = self._lanes.setdefault((w.tenant.id, w.tenant.priority), deque())
        if front:
            lane.appendleft(w)
        else:
            lane.append(w)
        self._where[w.job] = w
        self._waiting[w.tenant.id] += 1

    # ------------------------------------------------------------ the choice

    def _rank(self, w: _Waiting[J], now: float) -> tuple[int, float, int]:
        interactive = (
            w.tenant.priority is Priority.INTERACTIVE or now - w.since >= self.batch_aging_s
        )
        if not self.fair:
            return (0, 0.0, w.seq)
        return (0 if interactive else 1, w.start, w.seq)

    def peek(self, now: float) -> J | None:
        """The job to dispatch next, or None when nothing waits."""
        best: _Waiting[J] | None = None
        best_rank: tuple[int, float, int] | None = None
        for lane in self._lanes.values():
            rank = self._rank(lane[0], now)
            if best_rank is None or rank < best_rank:
                best, best_rank = lane[0], rank
        return None if best is None else best.job

    def ranked(self, now: float) -> list[J]:
        """Every waiting job, in the order they would be dispatched (``peek`` is the first):
        for a worker that cannot take the head (too little context), the next it can."""
        return [w.job for w in sorted(self._where.values(), key=lambda w: self._rank(w, now))]

    def pop(self, job: J) -> None:
        """``job`` (from ``peek`` or ``ranked``) was dispatched: it leaves and the virtual
        time moves on."""
        w = self._take(job)
        self._v = max(self._v, w.start)
        self._forget_idle()

    def remove(self, job: J) -> bool:
        """A waiting job withdrawn (its client left, or it waited too long)."""
        if job not in self._where:
            return False
        self._take(job)
        return True

    def _take(self, job: J) -> _Waiting[J]:
        w = self._where.pop(job)
        lane = self._lanes[(w.tenant.id, w.tenant.priority)]
        lane.remove(w)
        if not lane:
            del self._lanes[(w.tenant.id, w.tenant.priority)]
        self._waiting[w.tenant.id] -= 1
        if not self._waiting[w.tenant.id]:
            del self._waiting[w.tenant.id]
        return w

    def position(self, job: J, now: float) -> int:
        """How many waiting jobs will be dispatched before ``job`` (unless others arrive)."""
        w = self._where[job]
        rank = self._rank(w, now)
        return sum(1 for other in self._where.values() if self._rank(other, now) < rank)

    # ------------------------------------------------------------ afterwards

    def settle(self, tenant: Tenant, estimated: float, actual: float) -> None:
        """A job of ``tenant`` ended having done ``actual`` work where ``estimated`` was
        charged: its next jobs start that much later (or earlier, never before ``V``)."""
        if tenant.id in self._finish:
            corrected = self._finish[tenant.id] + (actual - estimated) / tenant.weight
            self._finish[tenant.id] = max(corrected, self._v)

    def _forget_idle(self) -> None:
        """A tenant whose finish tag is behind the virtual time starts at ``V`` anyway: its
        tag is dropped (so the state stays as small as the tenants that matter)."""
        for tenant_id in [t for t, f in self._finish.items() if f <= self._v]:
            if tenant_id not in self._waiting:
                del self._finish[tenant_id]
