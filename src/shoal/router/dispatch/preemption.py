"""Which running job to pause so that a waiting one of a tenant below its share starts now.

Fair queueing (``fair_queue.py``) decides who goes next when a slot frees; with every slot held
by one tenant's long answers, a light tenant still waits for one of them to end. Preemption
closes that gap: a running answer of a tenant above its share is paused (its worker cancels
it) and goes on later exactly where it stopped (``Continuation``: the ids of every token its
client has), and its slot goes to the waiting job at once.

The rules, all here (pure: data in, decision out; hypothesis-tested in
``tests/router/dispatch/test_preemption.py``):

* only when no slot is free for the waiting job (otherwise it is simply placed), and the freed
  slot goes to it at once: no slot is ever left idle (work-conserving);
* only for an *interactive* job; never for batch work, so interactive work is never paused for
  batch work;
* shares are weighted: with ``S`` slots, a tenant's share is ``S * w / W`` over the tenants
  running or waiting here. The waiting tenant must hold fewer slots than its share, the
  victim's tenant more than its share, and the move must narrow the gap between them: after
  it the waiting tenant holds, per unit of weight, less than the victim's tenant held before
  (``(h + 1) / w < H / W``), or the waiting tenant held nothing (one slot, two tenants: the
  light one gets it). A job that took its slot this way is never paused itself. So a tenant
  never takes back at once what was taken from it (no ping-pong; tested);
* only answers that can go on exactly (``resumable``: text, every token's id known, no tool
  call or reasoning) that produced at least ``MIN_TOKENS`` (their prompt is paid for, and an
  answer that just started is not thrown into a loop), and were paused fewer than
  ``MAX_PREEMPTIONS`` times (a job loses at most that many slots: thrash is bounded);
* the victim: batch work first, then the answer that produced the fewest tokens (going on
  costs a prefill of its prompt and its tokens, so this is the least recompute, and it is the
  answer furthest from its end, so pausing it delays no nearly-finished answer), then the one
  started last (it has held its slot the shortest).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

MAX_PREEMPTIONS = 1
"""Times one job may be paused for another."""
MIN_TOKENS = 8
"""Tokens an answer must have produced before it may be paused (at a few tens of tokens per
second per slot, a fraction of a second: a waiting job's wait stays far below a whole
answer's)."""


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A job on one of the slots the waiting job could use."""

    ref: Hashable
    """The caller's handle on the job."""
    tenant: str
    weight: float
    interactive: bool
    tokens: int
    """Tokens its client has (over every run)."""
    started: float
    """When it started (monotonic)."""
    resumable: bool
    """It can go on exactly from what its client has."""
    preemptions: int = 0
    took_slot: bool = False
    """It started on a slot it took by pausing another job."""


@dataclass(frozen=True, slots=True)
class WaitingJob:
    """The job at the head of the queue that waits for a slot."""

    tenant: str
    weight: float
    interactive: bool


def shares(weights: Mapping[str, float], slots: int) -> dict[str, float]:
    """Each tenant's weighted share of ``slots``."""
    total = sum(weights.values())
    return {t: slots * w / total for t, w in weights.items()} if total > 0 else {}


def choose_victim(
    running: Iterable[RunningJob],
    head: WaitingJob,
    waiting: Mapping[str, float],
    slots: int,
) -> RunningJob | None:
    """The running job to pause so that ``head`` starts now, or None.

    ``running``: every job on the slots ``head`` could use (``slots`` of them in all);
    ``waiting``: the weight of each tenant with jobs waiting for those slots."""
    jobs = list(running)
    if not head.interactive or len(jobs) < slots:
        return None  # batch work waits; a free slot is used without pausing anyone
    weights = dict(waiting)
    weights[head.tenant] = head.weight
    held: dict[str, int] = {}
    for job in jobs:
        weights.setdefault(job.tenant, job.weight)
        held[job.tenant] = held.get(job.tenant, 0) + 1
    share = shares(weights, slots)
    mine = held.get(head.tenant, 0)
    if mine >= share[head.tenant]:
        return None  # it has its share already

    def narrows(tenant: str) -> bool:
        return mine == 0 or (mine + 1) / head.weight < held[tenant] / weights[tenant]

    candidates = [
        job
        for job in jobs
        if job.tenant != head.tenant
        and held[job.tenant] > share[job.tenant]
        and narrows(job.tenant)
        and not job.took_slot
        and job.resumable
        and job.tokens >= MIN_TOKENS
        and job.preemptions < MAX_PREEMPTIONS
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda job: (job.interactive, job.tokens, -job.started))
