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

Residency. A worker serving several text models (each its own llama-server, loaded on
demand and evicted by measured bytes) reports each model's own state, slots and resident
bytes (``ModelInfo``), and the memory its models may hold together
(``Register.model_budget_bytes``); those count per model (``ModelLoad``). A model that
reports no state of its own is in its worker's state, with the worker's slots: the
single-model case, ranked exactly as before. A model not loaded with a job placed on it is
taken as loading (that job loads it; ``WorkerConnection.residency``) until the worker reports
it. A job's candidates rank, best first (``Residency``):

1. ``RESIDENT``: the model is loaded there with a slot of its own free (by prefix and load,
   as above; a single-model worker whose model is loaded);
2. ``LOADING``: it is loading there already, with a slot free (the job waits for that load);
3. ``LOADS``: it loads there into free memory, evicting nothing (the budget less the
   resident models' bytes holds it; a single-model worker unloaded after idling; a worker
   that says no budget or bytes decides itself);
4. otherwise, when the model is resident or loading on a worker that could run the job
   but has no slot free: no worker; the job waits for that one (waiting beats an eviction);
5. ``EVICTS``: it loads there once idle models make room (``models.residency.admit``, the
   rule the worker itself applies: never a pinned model, nor one with a running job or
   loading; a worker where it would have to wait for those, or could never fit, is no
   candidate). The eviction that costs least wins: first one that evicts no model this
   router gave a job within ``THRASH_WINDOW_S`` (``now``), then the least recently given
   one, then the fewest models.

"Thrash" is a worker evicting a model this router gave a job within ``THRASH_WINDOW_S``
while another worker could have held the new one without that. The order above makes it
impossible: a worker loading into free memory, and one evicting only models idle past the
window, both rank before any eviction of a recent model (``tests/router/dispatch/
test_residency_scheduling.py`` plays two workers by two models ping-ponging).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

from shoal.models.residency import Admit, Decision, Footprint, Resident, admit
from shoal.protocol.ids import ModelName, WorkerId
from shoal.protocol.messages import BackendState, Endpoint, ModelInfo
from shoal.protocol.prefix import expected_tokens, held_blocks

LOAD_COST_TOKENS = 512
"""What a worker with every slot busy is worth less than an idle one, in prompt tokens it
would have to compute: a busy worker's free slot shares its CPU with the jobs already there,
so a short match (a chat template's header, a shared one-line system prompt) does not beat
an idle worker, while a long one (1,000 tokens) stays where it is held."""


THRASH_WINDOW_S = 60.0
"""A model this router gave a job within this many seconds is evicted for another only when
no worker can take the other without that (module docstring: "thrash")."""


class Residency(enum.IntEnum):
    """How a worker would run a job's model, best first (module docstring)."""

    RESIDENT = 0
    LOADING = 1
    LOADS = 2
    EVICTS = 3


_RESIDENT_STATES = frozenset({BackendState.READY})
_LOADING_STATES = frozenset({BackendState.LOADING, BackendState.RESTARTING})


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One model of a worker that reports its own state (``ModelInfo.state``): several text
    models, or image models."""

    name: ModelName
    state: BackendState
    slots: int | None = None
    """Its own slots (None: the worker's, shared by every model there)."""
    running: int = 0
    """The jobs of it running there."""
    resident_bytes: int | None = None
    """What it holds when loaded (None: not known)."""
    pinned: bool = False
    last_assigned: float = 0.0
    """Monotonic time this router last gave it a job there (0: never)."""

    @property
    def resident(self) -> bool:
        return self.state in _RESIDENT_STATES

    @property
    def holds_memory(self) -> bool:
        """Loaded or loading: it holds (or is taking) its bytes."""
        return self.state in _RESIDENT_STATES or self.state in _LOADING_STATES


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
    residency: tuple[ModelLoad, ...] = ()
    """Its models that report a state of their own (the others are in the worker's)."""
    budget: int | None = None
    """What its resident text models may hold together (``Register.model_budget_bytes``)."""

    def model(self, name: ModelName) -> ModelLoad | None:
        """``name``'s own load here; None: it is in the worker's state, with its slots."""
        return next((m for m in self.residency if m.name == name), None)

    def occupancy(self, name: ModelName) -> tuple[int, int]:
        """(running, slots) that count for a job of ``name``: its own where it has slots of
        its own, else the worker's."""
        m = self.model(name)
        if m is not None and m.slots is not None:
            return m.running, m.slots
        return self.running, self.slots

    def free_for(self, name: ModelName) -> bool:
        running, slots = self.occupancy(name)
        return running < slots

    def free_slots(self) -> int:
        """Jobs it can take now over all its models: each model's own slots where it has
        them, the worker's for the others."""
        own = [m for m in self.residency if m.slots is not None]
        if not own:
            return max(self.slots - self.running, 0)
        free = sum(max((m.slots or 0) - m.running, 0) for m in own)
        if len({n for n, _ in self.models}) > len(own):  # some share the worker's slots
            free += max(self.slots - (self.running - sum(m.running for m in own)), 0)
        return free

    def fits(self, model: ModelName, need: int) -> bool:
        """A slot here holds ``need`` tokens of ``model``'s context (or it does not say)."""
        return need <= 0 or all(n >= need for m, n in self.contexts if m == model)


def contexts_of(models: Iterable[ModelInfo]) -> tuple[tuple[ModelName, int], ...]:
    """``WorkerLoad.contexts`` of a worker serving ``models``."""
    return tuple((m.name, m.context_length) for m in models if m.context_length is not None)


def expected_reuse(worker: WorkerLoad, prefix: tuple[int, ...]) -> int:
    """The prompt tokens ``worker`` is expected to reuse for a request with ``prefix``."""
    return expected_tokens(held_blocks(prefix, worker.cached)) if prefix else 0


def residency_of(w: WorkerLoad, model: ModelName) -> tuple[Residency, tuple[str, ...]] | None:
    """How ``w`` would run a job of ``model`` and what that load would evict there; None:
    it cannot now (no slot of the model's free, or ``admit`` says wait or never)."""
    if not w.free_for(model):
        return None
    own = w.model(model)
    if own is None:
        return (Residency.RESIDENT if w.loaded else Residency.LOADS), ()
    if own.resident:
        return Residency.RESIDENT, ()
    if own.holds_memory:
        return Residency.LOADING, ()
    decision = admission(w, own)
    if not isinstance(decision, Admit):
        return None
    return (Residency.EVICTS if decision.evict else Residency.LOADS), decision.evict


def admission(w: WorkerLoad, own: ModelLoad) -> Decision:
    """What loading ``own`` (one of ``w``'s models) takes there now, as the worker would
    decide (``models.residency.admit`` on what it reports): ``Admit()`` when it says no
    budget (it decides itself). A model of unknown size counts as the whole budget."""
    if w.budget is None:
        return Admit()
    need = Footprint(ram=w.budget if own.resident_bytes is None else own.resident_bytes)
    held = [
        Resident(
            m.name,
            Footprint(ram=m.resident_bytes or 0),
            m.last_assigned,
            pinned=m.pinned,
            busy=m.running > 0 or not m.resident,
        )
        for m in w.residency
        if m.holds_memory and m.name != own.name
    ]
    return admit(own.name, need, held, Footprint(ram=w.budget))


def _resident_somewhere(workers: Iterable[WorkerLoad], model: ModelName) -> bool:
    """``model`` is loaded (or loading) on one of ``workers``, which take it."""
    for w in workers:
        own = w.model(model)
        if (own.holds_memory if own is not None else w.loaded) and w.ready:
            return True
    return False


@dataclass(frozen=True, slots=True)
class Choice:
    """The worker ``choose`` picked, and how it runs the job."""

    worker: WorkerId
    residency: Residency
    evict: tuple[str, ...] = ()


def choose(
    workers: Iterable[WorkerLoad],
    model: ModelName,
    endpoint: Endpoint,
    prefix: tuple[int, ...] = (),
    need: int = 0,
    now: float = math.inf,
) -> Choice | None:
    """``pick_worker``, saying how the worker runs the job (its ``Residency``) and what its
    load evicts there."""
    best: tuple[tuple[object, ...], Choice] | None = None
    candidates: list[WorkerLoad] = []
    for w in workers:
        if not w.ready or (model, endpoint) not in w.models or not w.fits(model, need):
            continue
        candidates.append(w)
        how = residency_of(w, model)
        if how is None:
            continue
        tier, evict = how
        running, slots = w.occupancy(model)
        load = running / slots
        worth = expected_reuse(w, prefix) - LOAD_COST_TOKENS * load
        key = (tier, *_eviction_cost(w, evict, now), -worth, load, w.last_assigned, w.id)
        if best is None or key < best[0]:
            best = (key, Choice(w.id, tier, evict))
    if best is None:
        return None
    if best[1].residency is Residency.EVICTS and _resident_somewhere(candidates, model):
        return None  # waiting for the worker holding it beats an eviction
    return best[1]


def _eviction_cost(w: WorkerLoad, evict: tuple[str, ...], now: float) -> tuple[bool, float, int]:
    """What evicting ``evict`` on ``w`` costs: whether it evicts a model given a job within
    ``THRASH_WINDOW_S``, the newest of their last jobs here, and how many."""
    if not evict:
        return False, 0.0, 0
    newest = max(m.last_assigned for m in w.residency if m.name in evict)
    return now - newest < THRASH_WINDOW_S, newest, len(evict)


def pick_worker(
    workers: Iterable[WorkerLoad],
    model: ModelName,
    endpoint: Endpoint,
    prefix: tuple[int, ...] = (),
    need: int = 0,
    now: float = math.inf,
) -> WorkerId | None:
    """A ready worker serving ``model`` for ``endpoint`` with a free slot and ``need`` tokens
    of context per slot: the best by residency (module docstring), then the one worth most
    (expected reused tokens of ``prefix`` minus its load, above), else the least loaded.
    ``now``: monotonic time, against ``ModelLoad.last_assigned`` (``THRASH_WINDOW_S``).

    A worker whose model is loaded beats one that would have to load it again (after an idle
    unload), whatever their loads. Load is the fraction of slots in use; ties go to the less
    loaded, then the worker idle the longest, then by id so the answer never depends on
    iteration order.
    """
    chosen = choose(workers, model, endpoint, prefix, need, now)
    return chosen.worker if chosen is not None else None


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
    is not computed again. Likewise when that worker has the model resident (or loading) as a
    model of its own state and another worker serving it does not: held, the job does not
    make another router's worker load it. None (any router takes it) otherwise, or when the
    worker chosen is full, not ready or has too little context (``pick_worker`` skips
    those): a job is never held for a worker that cannot take it at once.
    """
    owners: dict[WorkerId, str] = {}
    loads: list[WorkerLoad] = []
    for owner, load in owned:
        if load.id not in owners:
            owners[load.id] = owner
            loads.append(load)
    chosen = choose(loads, model, endpoint, prefix, need)
    if chosen is None:
        return None
    worker = next(w for w in loads if w.id == chosen.worker)
    if prefix and expected_reuse(worker, prefix) >= MIN_HOLD_TOKENS:
        return owners[chosen.worker]
    if worker.model(model) is not None and chosen.residency < Residency.LOADS:
        others = (w for w in loads if w.ready and (model, endpoint) in w.models)
        if any(not _resident_somewhere([w], model) for w in others):
            return owners[chosen.worker]
    return None


def claim_limit(workers: Iterable[WorkerLoad], model: ModelName, endpoint: Endpoint) -> int:
    """With Redis: the most tokens of context a job of ``model`` for ``endpoint`` claimed for
    ``workers`` may need (``redis_queue/claim.py``): the largest context per slot of the
    ready ones serving it with a free slot for it (else of all the ready ones serving it: a job
    claimed waits here for one of them); 0 (any) when one of them does not say its context.

    A job too long for every worker that could take it now stays in Redis for a claimer
    whose worker can, rather than waiting here for a slot that may never hold it.
    """
    serving = [w for w in workers if w.ready and (model, endpoint) in w.models]
    free = [w for w in serving if w.free_for(model)] or serving
    most = 0
    for w in free:
        known = [n for m, n in w.contexts if m == model]
        if not known:
            return 0
        most = max(most, *known)
    return most
