"""Which worker gets the next job: a pure decision, tested with tables and hypothesis.

Among the workers with a free slot, each is worth the prompt tokens it is expected to reuse
for this request (the leading blocks of the request's prefix chain it holds,
``protocol/prefix.py``) minus ``LOAD_COST_TOKENS`` times the fraction of its slots in use.
So a hot prefix stays on the worker holding it while that worker has a slot free, however
busy it is, as long as the prefix is worth more than the load (a 1,000-token system prompt
is); when its slots are full it spills to the next best worker, which then holds it too.
A worker that is full is never chosen and a job waits only when every worker that could take
it is full, so no worker idles while another queues. With no prefix (``--routing
least-loaded``, or a request shorter than a block) this is least-loaded routing.

A worker whose context per slot is smaller than the request needs (``need``, in tokens,
``need.py``) is no candidate at all: llama-server would refuse the prompt, or cut the
answer short. A worker that does not say its context (an attached backend) is one.

With several routers on one Redis, ``hold_for`` names the router whose worker
``pick_worker`` would choose over the whole cluster, when that worker holds enough of the
prefix to be worth a short wait in Redis (``redis_queue/claim.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shoal.protocol.ids import ModelName, WorkerId
from shoal.protocol.messages import Endpoint, ModelInfo
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
    contexts: tuple[tuple[ModelName, int], ...] = ()
    """Each model's context per slot, in tokens (``ModelInfo.context_length``), where known."""

    def fits(self, model: ModelName, need: int) -> bool:
        """A slot here holds ``need`` tokens of ``model``'s context (or it does not say)."""
        return need <= 0 or all(n >= need for m, n in self.contexts if m == model)


def contexts_of(models: Iterable[ModelInfo]) -> tuple[tuple[ModelName, int], ...]:
    """``WorkerLoad.contexts`` of a worker serving ``models``."""
    return tuple((m.name, m.context_length) for m in models if m.context_length is not None)


def expected_reuse(worker: WorkerLoad, prefix: tuple[int, ...]) -> int:
    """The prompt tokens ``worker`` is expected to reuse for a request with ``prefix``."""
    return expected_tokens(held_blocks(prefix, worker.cached)) if prefix else 0


def pick_worker(
    workers: Iterable[WorkerLoad],
    model: ModelName,
    endpoint: Endpoint,
    prefix: tuple[int, ...] = (),
    need: int = 0,
) -> WorkerId | None:
    """A ready worker serving ``model`` for ``endpoint`` with a free slot and ``need`` tokens
    of context per slot: the one worth most (expected reused tokens of ``prefix`` minus its
    load, above), else the least loaded.

    A worker whose model is loaded beats one that would have to load it again (after an idle
    unload), whatever their loads. Load is the fraction of slots in use; ties go to the less
    loaded, then the worker idle the longest, then by id so the answer never depends on
    iteration order.
    """
    best: tuple[bool, float, float, float, str] | None = None
    for w in workers:
        if not w.ready or w.running >= w.slots or (model, endpoint) not in w.models:
            continue
        if not w.fits(model, need):
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
    need: int = 0,
) -> str | None:
    """With several routers on one Redis: the router whose worker should run a job with
    ``prefix`` and ``need`` (``owned``: every worker the cluster lists, with the consumer
    claiming its jobs: the router holding it, or a pull worker itself).

    That is the owner of the worker ``pick_worker`` chooses among all of them, when that
    worker is expected to reuse at least ``MIN_HOLD_TOKENS``: the job waits for that router
    to claim it (for a short, bounded hold), so a tenant's prefix held behind another router
    is not computed again. None (any router takes it) when no worker holds enough of it, or
    when the worker that does is full, not ready or has too little context (``pick_worker``
    skips those): a job is never held for a worker that cannot take it at once.
    """
    if not prefix:
        return None
    owners: dict[WorkerId, str] = {}
    loads: list[WorkerLoad] = []
    for owner, load in owned:
        if load.id not in owners:
            owners[load.id] = owner
            loads.append(load)
    best = pick_worker(loads, model, endpoint, prefix, need)
    if best is None:
        return None
    chosen = next(w for w in loads if w.id == best)
    return owners[best] if expected_reuse(chosen, prefix) >= MIN_HOLD_TOKENS else None


def claim_limit(workers: Iterable[WorkerLoad], model: ModelName, endpoint: Endpoint) -> int:
    """With Redis: the most tokens of context a job of ``model`` for ``endpoint`` claimed for
    ``workers`` may need (``redis_queue/claim.py``): the largest context per slot of the
    ready ones serving it with a free slot (else of all the ready ones serving it: a job
    claimed waits here for one of them); 0 (any) when one of them does not say its context.

    A job too long for every worker that could take it now stays in Redis for a claimer
    whose worker can, rather than waiting here for a slot that may never hold it.
    """
    serving = [w for w in workers if w.ready and (model, endpoint) in w.models]
    free = [w for w in serving if w.running < w.slots] or serving
    most = 0
    for w in free:
        known = [n for m, n in w.contexts if m == model]
        if not known:
            return 0
        most = max(most, *known)
    return most
