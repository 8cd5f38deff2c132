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
