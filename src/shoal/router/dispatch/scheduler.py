"""Which worker gets the next job: a pure decision, tested with tables and hypothesis.

Among the workers with a free slot, each is worth the prompt tokens it is expected to reuse
for this request (the leading blocks of the request's prefix chain it holds,
``protocol/prefix.py``) minus ``LOAD_COST_TOKENS`` times the fraction of its slots in use.
So a hot prefix stays on the worker holding it while that worker has a slot free, however
busy it is, as long as the prefix is worth more than the load (a 1,000-token system prompt
is); when its slots are full it spills to the next best worker, which then holds it too.
A worker that is full is never chosen and a job waits only when every worker is full, so no
worker idles while another queues. With no prefix (``--routing least-loaded``, or a request
shorter than a block) this is least-loaded routing.

With several routers on one Redis, ``hold_for`` names the router whose worker
``pick_worker`` would choose over the whole cluster, when that worker holds enough of the
prefix to be worth a short wait in Redis (``queue/redis_claim.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shoal.protocol.ids import ModelName, WorkerId
from shoal.protocol.messages import Endpoint
from shoal.protocol.prefix import expected_tokens, held_blocks

LOAD_COST_TOKENS = 512
"""What a worker with every slot busy is worth less than an idle one, in prompt tokens it
would have to compute: a busy worker's free slot shares its CPU with the jobs already there,
so a short match (a chat template's header, a shared one-line system prompt) does not beat
an idle worker, while a long one (1,000 tokens) stays where it is held."""


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What the scheduler needs to know of one worker."""

    id: WorkerId
    ready: bool
    models: frozenset[tuple[ModelName, Endpoint]]
    slots: int
    running: int
    last_assigned: float = 0.0
    """Monotonic time of the last job handed to it; breaks ties so equal workers alternate."""
    loaded: bool = True
    """False when its model is unloaded after idling: it takes jobs, but must load first."""
    cached: frozenset[int] = frozenset()
    """The prefix hashes its slots hold (``protocol.prefix``), as it last reported them."""


def expected_reuse(worker: WorkerLoad, prefix: tuple[int, ...]) -> int:
    """The prompt tokens ``worker`` is expected to reuse for a request with ``prefix``."""
    return expected_tokens(held_blocks(prefix, worker.cached)) if prefix else 0


def pick_worker(
    workers: Iterable[WorkerLoad],
    model: ModelName,
    endpoint: Endpoint,
    prefix: tuple[int, ...] = (),
) -> WorkerId | None:
    """A ready worker serving ``model`` for ``endpoint`` with a free slot: the one worth most
    (expected reused tokens of ``prefix`` minus its load, above), else the least loaded.

    A worker whose model is loaded beats one that would have to load it again (after an idle
    unload), whatever their loads. Load is the fraction of slots in use; ties go to the less
    loaded, then the worker idle the longest, then by id so the answer never depends on
    iteration order.
    """
    best: tuple[bool, float, float, float, str] | None = None
    for w in workers:
        if not w.ready or w.running >= w.slots or (model, endpoint) not in w.models:
            continue
        load = w.running / w.slots
        worth = expected_reuse(w, prefix) - LOAD_COST_TOKENS * load
        key = (not w.loaded, -worth, load, w.last_assigned, w.id)
        if best is None or key < best:
            best = key
    return WorkerId(best[4]) if best is not None else None


MIN_HOLD_TOKENS = 256
"""The prompt tokens a worker must be expected to reuse before a job waits in Redis for its
router (``hold_for``): a template's header or a one-line prompt is not worth the wait."""


def hold_for(
    owned: Iterable[tuple[str, WorkerLoad]],
    model: ModelName,
    endpoint: Endpoint,
    prefix: tuple[int, ...],
) -> str | None:
    """With several routers on one Redis: the router whose worker should run a job with
    ``prefix`` (``owned``: every worker the cluster lists, with the consumer claiming its
    jobs: the router holding it, or a pull worker itself).

    That is the owner of the worker ``pick_worker`` chooses among all of them, when that
    worker is expected to reuse at least ``MIN_HOLD_TOKENS``: the job waits for that router
    to claim it (for a short, bounded hold), so a tenant's prefix held behind another router
    is not computed again. None (any router takes it) when no worker holds enough of it, or
    when the worker that does is full or not ready (``pick_worker`` skips those): a job is
    never held for a worker that cannot take it at once.
    """
    if not prefix:
        return None
    owners: dict[WorkerId, str] = {}
    loads: list[WorkerLoad] = []
    for owner, load in owned:
        if load.id not in owners:
            owners[load.id] = owner
            loads.append(load)
    best = pick_worker(loads, model, endpoint, prefix)
    if best is None:
        return None
    chosen = next(w for w in loads if w.id == best)
    return owners[best] if expected_reuse(chosen, prefix) >= MIN_HOLD_TOKENS else None
