"""When a worker that streams answers is taken for frozen (pure).

A frozen worker (stopped with SIGSTOP, a machine swapping itself to death) keeps its
connection open and sends nothing: without this rule its answers wait for the heartbeat
timeout (``--heartbeat-interval`` x ``--heartbeat-misses``, 15 s by default). The rule:

    a worker holding jobs is frozen when nothing at all (no chunk, no heartbeat) came from it
    for ``--stall-timeout`` seconds while another worker was heard from in that time.

A live worker sends a heartbeat every ``--heartbeat-interval`` whatever its backend does, and
the stall timeout is kept above that interval, so a slow but live worker (a long prompt, a
slow machine) is never taken for frozen; only a worker whose process stopped is. "Another
worker was heard from" keeps a router that was itself stalled (or cut off from every
worker) from blaming its workers: with a single worker the rule never fires and the
heartbeat timeout applies.

With ``--redis-url`` the other workers may be another router's: the router also counts as
heard from the end of its last worker-directory sync (``dispatch/directory.py``) that found
another router's worker (``Dispatcher.heard_from_cluster``). That round trip proves what
the rule needs: this router was running and reaching the cluster then, and a worker was
there to take the jobs over; a sync that found no other worker proves nothing of the sort
(a lone worker in the whole cluster still waits for the heartbeat timeout). A sync runs
every ``--heartbeat-interval``, which the stall timeout is kept above, so a frozen worker
is found about the stall timeout after its last frame. A slower sync (Redis slow or down,
its retries backing off) makes the last one older: the rule then fires later or not at
all (the heartbeat timeout applies), never wrongly.
"""

from __future__ import annotations

from collections.abc import Iterable


def frozen(
    now: float,
    last_seen: float,
    holds_jobs: bool,
    others_last_seen: Iterable[float],
    stall_timeout: float,
) -> bool:
    if stall_timeout <= 0 or not holds_jobs or now - last_seen < stall_timeout:
        return False
    return any(now - seen < stall_timeout for seen in others_last_seen)


def next_check(now: float, last_seen: float, stall_timeout: float) -> float:
    """When to look again (seconds from now): when the worker would have been silent for
    the stall timeout, or, past that, a quarter of it later (others may be heard from)."""
    due = last_seen + stall_timeout - now
    return due if due > 0 else stall_timeout / 4
