"""``models/residency.py``: which loaded models make room for another. Tables for the rules,
then hypothesis against a brute force over every subset."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.models.residency import (
    Admit,
    Footprint,
    Refuse,
    Resident,
    Wait,
    admit,
    footprint_sum,
)

GIB = 2**30


def gib(ram: float = 0, *gpus: float) -> Footprint:
    return Footprint(int(ram * GIB), tuple(int(g * GIB) for g in gpus))


def res(
    model: str, size: float, last: float, *, pinned: bool = False, busy: bool = False
) -> Resident:
    return Resident(model, gib(size), last, pinned=pinned, busy=busy)


BUDGET = gib(10)


@pytest.mark.parametrize(
    ("resident", "need", "expected"),
    [
        # fits beside them: nothing evicted
        ([res("a", 4, 1), res("b", 3, 2)], 3, Admit()),
        # the least recently used goes first
        ([res("a", 4, 2), res("b", 4, 1)], 4, Admit(("b",))),
        # never more than needed: evicting the oldest (small) alone is not enough, the next
        # oldest (big) is; then the small one need not go
        ([res("small", 1, 1), res("big", 5, 2), res("c", 4, 3)], 5, Admit(("big",))),
        # two are needed, oldest first
        ([res("a", 3, 1), res("b", 3, 2), res("c", 3, 3)], 7, Admit(("a", "b"))),
        # pinned and busy models are never evicted
        ([res("a", 4, 1, pinned=True), res("b", 4, 2)], 5, Admit(("b",))),
        ([res("a", 4, 1, busy=True), res("b", 4, 2)], 5, Admit(("b",))),
    ],
)
def test_admit_table(resident: list[Resident], need: float, expected: Admit) -> None:
    assert admit("new", gib(need), resident, BUDGET) == expected


def test_too_big_alone_is_refused_with_its_numbers() -> None:
    decision = admit("huge", gib(12), [], BUDGET)
    assert isinstance(decision, Refuse)
    assert "huge" in decision.reason and "12.0 GiB" in decision.reason
    assert "10.0 GiB" in decision.reason


def test_no_room_beside_the_pinned_is_refused() -> None:
    decision = admit("new", gib(7), [res("p", 4, 1, pinned=True)], BUDGET)
    assert isinstance(decision, Refuse) and "pinned" in decision.reason and "p" in decision.reason


def test_room_held_by_busy_models_waits() -> None:
    decision = admit("new", gib(7), [res("a", 4, 1, busy=True), res("b", 2, 2)], BUDGET)
    assert isinstance(decision, Wait) and "a" in decision.reason


def test_each_gpu_is_its_own_pool() -> None:
    budget = gib(4, 8, 8)
    on_gpu1 = Resident("g1", gib(0.5, 0, 6), 1)
    on_gpu0 = Resident("g0", gib(0.5, 6, 0), 2)
    # it needs GPU 1: the model there goes, though the one on GPU 0 is newer and big
    assert admit("new", gib(0.5, 0, 4), [on_gpu1, on_gpu0], budget) == Admit(("g1",))
    # a model on a GPU the budget lacks never fits
    assert isinstance(admit("new", gib(0, 0, 0, 1), [], budget), Refuse)


def test_footprint_describes_where_its_bytes_are() -> None:
    assert gib(1, 3).describe() == "4.0 GiB (RAM 1.0 GiB, GPU 0 3.0 GiB)"
    assert gib(1) + gib(0, 0, 2) == Footprint(GIB, (0, 2 * GIB))


# ------------------------------------------------------------- properties, by brute force

sizes = st.integers(min_value=0, max_value=6)
footprints = st.builds(lambda r, g: Footprint(r, (g,)), sizes, sizes)
residents = st.lists(
    st.builds(
        Resident,
        model=st.sampled_from("abcdefgh"),
        footprint=footprints,
        last_used=st.integers(0, 5).map(float),
        pinned=st.booleans(),
        busy=st.booleans(),
    ),
    max_size=6,
    unique_by=lambda r: r.model,
)


@settings(max_examples=400, deadline=None)
@given(
    residents,
    footprints,
    st.builds(lambda r, g: Footprint(r, (g,)), st.integers(0, 14), st.integers(0, 14)),
)
def test_admit_against_brute_force(
    resident: list[Resident], need: Footprint, budget: Footprint
) -> None:
    decision = admit("new", need, resident, budget)
    evictable = [r for r in resident if not r.pinned and not r.busy]

    def fits(evicted: tuple[Resident, ...]) -> bool:
        kept = footprint_sum(r.footprint for r in resident if r not in evicted)
        return (kept + need).within(budget)

    any_now = [
        s
        for n in range(len(evictable) + 1)
        for s in itertools.combinations(evictable, n)
        if fits(s)
    ]
    if isinstance(decision, Admit):
        evicted = tuple(r for r in resident if r.model in decision.evict)
        assert len(evicted) == len(decision.evict)  # only models that are loaded
        assert all(not r.pinned and not r.busy for r in evicted)
        assert fits(evicted)
        for r in evicted:  # never more than needed: each one had to go
            assert not fits(tuple(e for e in evicted if e is not r))
    else:
        assert not any_now  # it does not admit only when no choice of evictions fits now
        unpinned_all = tuple(r for r in resident if not r.pinned)
        if isinstance(decision, Wait):
            assert fits(unpinned_all)  # once the busy ones finish, it fits
        else:
            assert not fits(unpinned_all)
