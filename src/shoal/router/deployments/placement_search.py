"""The layer planner's search (pure): the devices in order, what a range of layers costs on
each, and the exact best split by a dynamic program over split points (``placement`` holds
the vocabulary and turns the split into a plan).

Every node contributes its **places**, in llama.cpp's order: its CPU (its RAM), then its
GPUs. A place holds one contiguous range of layers (maybe empty); ranges follow the places'
order. A range on a GPU that starts at layer 0 puts the token embedding in its node's RAM,
which comes before it and holds no layers then: the embedding is checked against that RAM
and counted there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Protocol


class ProfileLike(Protocol):
    """What the search reads of ``placement.ModelProfile`` (``placement`` imports this
    module, so the search knows its vocabulary only by these shapes)."""

    @property
    def n_layers(self) -> int: ...

    @property
    def layer_weight_bytes(self) -> tuple[int, ...]: ...

    @property
    def kv_bytes_per_token(self) -> tuple[int, ...]: ...

    @property
    def head_bytes(self) -> int: ...

    @property
    def tail_bytes(self) -> int: ...

    @property
    def compute_bytes(self) -> int: ...


class GpuLike(Protocol):
    """What the search reads of ``placement.Gpu``."""

    @property
    def name(self) -> str: ...

    @property
    def free_bytes(self) -> int: ...


class NodeLike(Protocol):
    """What the search reads of ``placement.Node``."""

    @property
    def free_bytes(self) -> int: ...

    @property
    def gpus(self) -> Sequence[GpuLike]: ...


_CPU = "CPU"

Cuts = tuple[int, ...]
"""Split points: place ``j`` holds layers ``[cuts[j], cuts[j + 1])``; empty when equal."""
_Key = tuple[int, int, int]
"""An additive score, compared lexicographically; lower is better: layers on spill places,
the strategy's score, then the tie-break towards the head."""
_Moves = Callable[[int, int], Iterator[int]]
"""``moves(j, p)``: the ends ``q`` that place ``j`` may take when its range starts at ``p``."""
_Score = Callable[[int, int, int], _Key]
"""``score(j, p, q)``: the cost of place ``j`` holding ``[p, q)``."""


@dataclass(frozen=True, slots=True)
class Place:
    """One device of one node, as the search sees it."""

    node: int
    """The node's index."""
    device: str
    free: int
    budget: int
    """What it may use: ``free * (1 - headroom)``, rounded down."""
    spill: bool
    """The RAM of a node with GPUs: takes layers only when nothing else fits."""
    host: int
    """The index of its node's CPU place (where the token embedding stays)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """What any contiguous range of layers costs, and where it may go."""

    n: int
    weight_prefix: tuple[int, ...]
    kv_prefix: tuple[int, ...]
    ctx: int
    head: int
    tail: int
    compute: int
    places: tuple[Place, ...]

    @classmethod
    def build(
        cls, profile: ProfileLike, nodes: Sequence[NodeLike], ctx: int, headroom: float
    ) -> Layout:
        places: list[Place] = []
        for i, node in enumerate(nodes):
            host = len(places)
            devices = [(_CPU, node.free_bytes), *((g.name, g.free_bytes) for g in node.gpus)]
            for device, free in devices:
                budget = math.floor(free * (1.0 - headroom))
                spill = device == _CPU and bool(node.gpus)
                places.append(Place(i, device, free, budget, spill, host))
        return cls(
            n=profile.n_layers,
            weight_prefix=(0, *_accumulate(profile.layer_weight_bytes)),
            kv_prefix=(0, *_accumulate(profile.kv_bytes_per_token)),
            ctx=ctx,
            head=profile.head_bytes,
            tail=profile.tail_bytes,
            compute=profile.compute_bytes,
            places=tuple(places),
        )

    def weights(self, j: int, p: int, q: int) -> int:
        """Weights of layers ``[p, q)`` on place ``j``, with the token embedding (on a CPU
        place holding layer 0) and the output layer (with the last layer)."""
        if p == q:
            return 0
        head = self.head if p == 0 and self.places[j].device == _CPU else 0
        return self.weight_prefix[q] - self.weight_prefix[p] + head + self.tail_of(q)

    def tail_of(self, q: int) -> int:
        return self.tail if q == self.n else 0

    def kv(self, p: int, q: int) -> int:
        return (self.kv_prefix[q] - self.kv_prefix[p]) * self.ctx

    def compute_for(self, p: int, q: int) -> int:
        return self.compute if q > p else 0

    def cost(self, j: int, p: int, q: int) -> int:
        return self.weights(j, p, q) + self.kv(p, q) + self.compute_for(p, q)

    def embedding_in_ram(self, j: int, p: int, q: int) -> int:
        """The token embedding that place ``j`` holding ``[p, q)`` puts in its node's RAM
        when ``j`` is a GPU (on a CPU place ``weights`` counts it)."""
        return self.head if p == 0 < q and self.places[j].device != _CPU else 0

    def fits(self, j: int, p: int, q: int) -> bool:
        place = self.places[j]
        ram = self.places[place.host].budget
        return self.cost(j, p, q) <= place.budget and self.embedding_in_ram(j, p, q) <= ram

    def spilled(self, cuts: Cuts) -> int:
        """Layers on spill places."""
        return sum(b - a for j, (a, b) in enumerate(pairwise(cuts)) if self.places[j].spill)


def _accumulate(values: Sequence[int]) -> Iterator[int]:
    total = 0
    for value in values:
        total += value
        yield total


def _search(m: int, n: int, moves: _Moves, score: _Score) -> Cuts | None:
    """The lowest-scoring split of layers ``[0, n)`` into ``m`` ranges, or None if none.

    A dynamic program over split points: ``best[p]`` is the best score of the places so far
    covering ``[0, p)``. Scores add up and compare lexicographically, so the best whole
    split extends a best prefix. Ties keep the first candidate met: the one that gives the
    earlier places more layers.
    """
    best: list[_Key | None] = [(0, 0, 0)] + [None] * n
    back: list[list[int]] = []
    for j in range(m):
        nxt: list[_Key | None] = [None] * (n + 1)
        came_from = [-1] * (n + 1)
        for p in range(n, -1, -1):
            prefix = best[p]
            if prefix is None:
                continue
            for q in moves(j, p):
                s = score(j, p, q)
                key = (prefix[0] + s[0], prefix[1] + s[1], prefix[2] + s[2])
                current = nxt[q]
                if current is None or key < current:
                    nxt[q] = key
                    came_from[q] = p
        back.append(came_from)
        best = nxt
    if best[n] is None:
        return None
    cuts = [n]
    for came_from in reversed(back):
        cuts.append(came_from[cuts[-1]])
    return tuple(reversed(cuts))


def _fitting_moves(layout: Layout, cap: int) -> _Moves:
    """Ranges that fit place ``j``'s budget and, unless it is a spill place, hold at most
    ``cap`` layers (or none)."""

    def moves(j: int, p: int) -> Iterator[int]:
        yield p
        longest = layout.n - p if layout.places[j].spill else min(layout.n - p, cap)
        for q in range(p + 1, p + longest + 1):
            if not layout.fits(j, p, q):
                return  # a longer range from p costs at least as much
            yield q

    return moves


def _proportional_score(layout: Layout) -> _Score:
    """Layers on spill places first; then the squared distance from each other place's
    share ``n * free / total``, scaled to integers."""
    places, n = layout.places, layout.n
    total = sum(place.free for place in places if not place.spill)

    def score(j: int, p: int, q: int) -> _Key:
        c = q - p
        if places[j].spill:
            return (c, 0, j * c)
        return (0, (c * total - n * places[j].free) ** 2, j * c)

    return score


def _even_score(layout: Layout) -> _Score:
    places = layout.places

    def score(j: int, p: int, q: int) -> _Key:
        c = q - p
        return (c, 0, j * c) if places[j].spill else (0, c * c, j * c)

    return score


def proportional(layout: Layout) -> Cuts | None:
    """The ``PROPORTIONAL`` strategy's best split, or None when nothing fits."""
    moves = _fitting_moves(layout, layout.n)
    return _search(len(layout.places), layout.n, moves, _proportional_score(layout))


def balanced(layout: Layout) -> Cuts | None:
    """The ``BALANCED`` strategy's best split, or None when nothing fits: the most even
    split among those with the fewest spilled layers whose largest range (off spill places)
    is as small as possible."""
    m, n, score = len(layout.places), layout.n, _even_score(layout)
    best = _search(m, n, _fitting_moves(layout, n), score)
    if best is None:
        return None
    spilled = layout.spilled(best)
    ordinary = [j for j, place in enumerate(layout.places) if not place.spill]
    low = -(-n // m) if len(ordinary) == m else 0
    high = max((best[j + 1] - best[j] for j in ordinary), default=0)
    while low < high:  # the smallest cap on layers per place that spills no more
        mid = (low + high) // 2
        cuts = _search(m, n, _fitting_moves(layout, mid), score)
        if cuts is None or layout.spilled(cuts) > spilled:
            low = mid + 1
        else:
            best, high = cuts, mid
    return best


@dataclass(frozen=True, slots=True)
class Overflow:
    """The assignment that overflows the places the least, for explaining a failure."""

    cuts: Cuts
    needed: int
    available: int
    shortfall: int
    weights: int


def least_overflow(layout: Layout) -> Overflow:
    def all_moves(j: int, p: int) -> Iterator[int]:
        return iter(range(p, layout.n + 1))

    def over(j: int, p: int, q: int) -> int:
        host = layout.places[layout.places[j].host].budget
        return max(0, layout.cost(j, p, q) - layout.places[j].budget) + max(
            0, layout.embedding_in_ram(j, p, q) - host
        )

    def overflow(j: int, p: int, q: int) -> _Key:
        return (over(j, p, q), layout.cost(j, p, q) + layout.embedding_in_ram(j, p, q), 0)

    cuts = _search(len(layout.places), layout.n, all_moves, overflow)
    if cuts is None:  # unreachable: without budgets every split is allowed
        raise AssertionError("the unconstrained search always finds a split")
    ranges = held(cuts)
    return Overflow(
        cuts=cuts,
        needed=sum(overflow(j, p, q)[1] for j, p, q in ranges),
        available=sum(place.budget for place in layout.places),
        shortfall=sum(over(j, p, q) for j, p, q in ranges),
        weights=sum(
            layout.weights(j, p, q) + layout.embedding_in_ram(j, p, q) for j, p, q in ranges
        ),
    )


def held(cuts: Cuts) -> list[tuple[int, int, int]]:
    """``(place index, start, end)`` of each place that holds at least one layer."""
    return [(j, cuts[j], cuts[j + 1]) for j in range(len(cuts) - 1) if cuts[j + 1] > cuts[j]]
