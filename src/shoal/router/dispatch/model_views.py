"""What this router's workers add up to per model, kept up to date as they change.

A worker's share of the view (its ``Share``: per model it serves, its state there, endpoints,
context and when it connected) is added when it registers, taken out when it leaves, and
taken out and added again when its models, backend state or connection change (the
``Registry`` does it: ``WorkerConnection`` tells it). Each of those is O(models of the
worker); a heartbeat that changes none of them costs nothing here.

What reads it, per request and never over every worker: ``/health`` and ``/v1/models``
(the per-model counts), the dispatcher's answers (is a model served, for which endpoints,
with what context) and placement (only the workers serving the request's model and
endpoint are candidates). ``tests/router/dispatch/test_model_views.py`` holds it to the full
recomputation over every worker.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from shoal.protocol.ids import ModelName, WorkerId
from shoal.protocol.messages import BackendState, Endpoint, ModelInfo

K = TypeVar("K")


class Member(Protocol):
    """What the views read of a worker (``workers.WorkerConnection``, which imports this
    module: the views know it only by this)."""

    @property
    def id(self) -> WorkerId: ...

    @property
    def models(self) -> tuple[ModelInfo, ...]: ...

    @property
    def backend_state(self) -> BackendState: ...

    @property
    def connected_at(self) -> float: ...

    @property
    def ready(self) -> bool: ...


W = TypeVar("W", bound=Member)


@dataclass(frozen=True, slots=True)
class Share:
    """One worker's part in one model's view."""

    model: ModelName
    state: BackendState
    """The model's own state (image models) or else the worker's backend state."""
    endpoints: tuple[Endpoint, ...]
    context: int | None
    created: int
    """When the worker connected, whole seconds of wall-clock time (``/v1/models`` created)."""
    resident_bytes: int | None = None
    """What the model holds there when loaded (``ModelInfo.resident_bytes``)."""
    load_seconds: float | None = None
    """Its last load there took this long (``ModelInfo.load_seconds``)."""


def shares_of(worker: Member) -> tuple[Share, ...]:
    """What ``worker`` adds to the views: one share per model it serves."""
    created = int(worker.connected_at)
    return tuple(
        Share(
            m.name,
            m.state or worker.backend_state,
            m.endpoints,
            m.context_length,
            created,
            m.resident_bytes,
            m.load_seconds,
        )
        for m in worker.models
    )


@dataclass(slots=True)
class ModelView(Generic[W]):
    """The workers serving one model here, and their counts."""

    states: Counter[BackendState] = field(default_factory=Counter)
    endpoints: Counter[Endpoint] = field(default_factory=Counter)
    created: Counter[int] = field(default_factory=Counter)
    context: Counter[int | None] = field(default_factory=Counter)
    """How many of its entries have each context per slot, whatever the endpoint."""
    contexts: dict[Endpoint, Counter[int | None]] = field(default_factory=dict)
    """Per endpoint, how many workers have each context per slot (None: does not say)."""
    serving: dict[Endpoint, dict[WorkerId, W]] = field(default_factory=dict)
    """Per endpoint, the workers serving the model for it."""
    workers: Counter[WorkerId] = field(default_factory=Counter)
    """The workers serving it (a count, in case one lists the model twice)."""
    resident_bytes: Counter[int] = field(default_factory=Counter)
    """How many of its entries report each resident size (where they report one)."""
    load_seconds: Counter[float] = field(default_factory=Counter)
    """How many of its entries report each last load time (where they report one)."""

    def add(self, worker: W, share: Share, sign: int) -> None:
        """Count ``share`` in (``sign`` +1) or out (-1)."""
        _bump(self.states, share.state, sign)
        _bump(self.created, share.created, sign)
        _bump(self.context, share.context, sign)
        _bump(self.workers, worker.id, sign)
        if share.resident_bytes is not None:
            _bump(self.resident_bytes, share.resident_bytes, sign)
        if share.load_seconds is not None:
            _bump(self.load_seconds, share.load_seconds, sign)
        for endpoint in share.endpoints:
            _bump(self.endpoints, endpoint, sign)
            _bump(self.contexts.setdefault(endpoint, Counter()), share.context, sign)
            serving = self.serving.setdefault(endpoint, {})
            if sign > 0:
                serving[worker.id] = worker
            else:
                serving.pop(worker.id, None)

    def __bool__(self) -> bool:
        return bool(self.workers)

    def entries(self) -> int:
        """How many (worker, model) entries there are (``/v1/models`` workers)."""
        return sum(self.states.values())


def _bump(counter: Counter[K], key: K, sign: int) -> None:
    """Counters keep only what is there (a state at 0 would still be listed)."""
    counter[key] += sign
    if counter[key] <= 0:
        del counter[key]


class ModelViews(Generic[W]):
    """Every model's view, and the counts ``/health`` reads."""

    def __init__(self) -> None:
        self._views: dict[ModelName, ModelView[W]] = {}
        self._shares: dict[WorkerId, tuple[Share, ...]] = {}
        self._ready: set[WorkerId] = set()

    def put(self, worker: W) -> None:
        """Add ``worker``'s shares, or replace the ones it had (its models or state changed)."""
        self.drop(worker)
        shares = shares_of(worker)
        self._shares[worker.id] = shares
        for share in shares:
            view = self._views.get(share.model)
            if view is None:  # a view is built only for a model new here
                view = self._views[share.model] = ModelView[W]()
            view.add(worker, share, +1)
        if worker.ready:
            self._ready.add(worker.id)

    def drop(self, worker: W) -> None:
        """Take ``worker``'s shares out (it left)."""
        for share in self._shares.pop(worker.id, ()):
            view = self._views[share.model]
            view.add(worker, share, -1)
            if not view:
                del self._views[share.model]
        self._ready.discard(worker.id)

    def models(self) -> Collection[ModelName]:
        return self._views.keys()

    def view(self, model: ModelName) -> ModelView[W] | None:
        return self._views.get(model)

    def serving(self, model: ModelName, endpoint: Endpoint) -> Collection[W]:
        """The workers serving ``model`` for ``endpoint`` (not to be iterated while the
        registry changes)."""
        view = self._views.get(model)
        found = view.serving.get(endpoint) if view is not None else None
        return found.values() if found is not None else ()

    def ready(self) -> int:
        """How many workers are ready (connected, backend ready)."""
        return len(self._ready)
