"""Which text models stay loaded on a worker: a pure decision, data in and out.

A worker serving several text models keeps loaded as many as its memory holds. What a model
holds (its ``Footprint``: bytes of RAM and of each GPU) is what llama-server reported on its
last load (weights + KV cache + compute buffers), else the fit estimate before a first load.
The budget is the worker's free memory when it started (or an operator's cap).

``admit`` decides, for a model about to load, which loaded ones make room:

- it fits beside the loaded ones: load it, evict nothing;
- else evict the least recently used models that are neither pinned nor busy (running or
  waiting on a job, or loading), oldest first, until it fits; then keep back every one of
  those whose eviction turns out not to be needed (newest first), so no model is evicted
  that the load could do without;
- when even that is not enough, but it would fit once busy models finish: ``Wait``;
- when it cannot fit beside the pinned models, or not even alone: ``Refuse``, naming the
  numbers.

The worker calls it before every load; the router calls the same function on what workers
report, to see what a load there would evict. Nothing here does I/O or logs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shoal.units import format_bytes


@dataclass(frozen=True, slots=True)
class Footprint:
    """Bytes of memory, in RAM and on each GPU (in the worker's GPU order)."""

    ram: int = 0
    gpus: tuple[int, ...] = ()

    def __add__(self, other: Footprint) -> Footprint:
        n = max(len(self.gpus), len(other.gpus))
        mine = self.gpus + (0,) * (n - len(self.gpus))
        theirs = other.gpus + (0,) * (n - len(other.gpus))
        return Footprint(
            self.ram + other.ram, tuple(a + b for a, b in zip(mine, theirs, strict=True))
        )

    @property
    def total(self) -> int:
        return self.ram + sum(self.gpus)

    def within(self, budget: Footprint) -> bool:
        """No pool holds more than ``budget`` gives it (a GPU it does not list has none)."""
        if self.ram > budget.ram:
            return False
        return all(
            held <= (budget.gpus[i] if i < len(budget.gpus) else 0)
            for i, held in enumerate(self.gpus)
            if held
        )

    def describe(self) -> str:
        """``4.1 GiB (RAM 1.0 GiB, GPU 0 3.1 GiB)``: where each byte is."""
        parts = [f"RAM {format_bytes(self.ram)}"] if self.ram else []
        parts += [f"GPU {i} {format_bytes(b)}" for i, b in enumerate(self.gpus) if b]
        return f"{format_bytes(self.total)} ({', '.join(parts) or 'nothing'})"


def footprint_sum(footprints: Iterable[Footprint]) -> Footprint:
    total = Footprint()
    for f in footprints:
        total = total + f
    return total


@dataclass(frozen=True, slots=True)
class Resident:
    """A model loaded (or loading) now."""

    model: str
    footprint: Footprint
    last_used: float
    """When a job last used it (any clock, the same for all): the lowest is evicted first."""
    pinned: bool = False
    """Never evicted."""
    busy: bool = False
    """A job runs on it or waits for it, or it is loading: not evicted now."""


@dataclass(frozen=True, slots=True)
class Admit:
    """Load it once these are evicted (none: it fits beside them)."""

    evict: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Wait:
    """It fits once busy models finish their jobs and can be evicted: ask again then."""

    reason: str


@dataclass(frozen=True, slots=True)
class Refuse:
    """It cannot load here: it does not fit even alone, or not beside the pinned models."""

    reason: str


Decision = Admit | Wait | Refuse


def admit(model: str, need: Footprint, resident: Sequence[Resident], budget: Footprint) -> Decision:
    """What loading ``model`` (which needs ``need``) takes, with ``resident`` loaded and
    ``budget`` to hold them all (module docstring). ``resident`` never lists ``model``."""
    if not need.within(budget):
        return Refuse(
            f"model {model} needs {need.describe()}, more than this worker's whole budget "
            f"for models, {budget.describe()}: give it a smaller quantization or context "
            "(--ctx-size), or serve it on a bigger machine"
        )
    used = footprint_sum(r.footprint for r in resident)
    if (used + need).within(budget):
        return Admit()
    pinned = [r for r in resident if r.pinned]
    if not (footprint_sum(r.footprint for r in pinned) + need).within(budget):
        names = ", ".join(sorted(r.model for r in pinned))
        return Refuse(
            f"model {model} needs {need.describe()}, which does not fit beside the pinned "
            f"model(s) {names} in this worker's budget of {budget.describe()}: unpin one, "
            "or serve it on another worker"
        )
    idle = sorted(
        (r for r in resident if not r.pinned and not r.busy),
        key=lambda r: (r.last_used, r.model),
    )
    chosen: list[Resident] = []
    for r in idle:
        if _fits_without(chosen, resident, need, budget):
            break
        chosen.append(r)
    if not _fits_without(chosen, resident, need, budget):
        busy = ", ".join(sorted(r.model for r in resident if r.busy and not r.pinned))
        return Wait(
            f"model {model} needs {need.describe()}; it fits once {busy} finish their jobs "
            "and can be unloaded"
        )
    for r in reversed(list(chosen)):  # the newest first: keep what need not go
        rest = [c for c in chosen if c is not r]
        if _fits_without(rest, resident, need, budget):
            chosen = rest
    return Admit(tuple(r.model for r in chosen))


def _fits_without(
    evicted: Sequence[Resident], resident: Sequence[Resident], need: Footprint, budget: Footprint
) -> bool:
    gone = {id(r) for r in evicted}
    kept = footprint_sum(r.footprint for r in resident if id(r) not in gone)
    return (kept + need).within(budget)
