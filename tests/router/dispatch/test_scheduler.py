"""pick_worker: a table of cases and properties over random clusters."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.protocol.ids import ModelName, WorkerId
from shoal.protocol.messages import Endpoint
from shoal.protocol.prefix import expected_tokens
from shoal.router.dispatch.scheduler import (
    LOAD_COST_TOKENS,
    MIN_HOLD_TOKENS,
    WorkerLoad,
    claim_limit,
    expected_reuse,
    hold_for,
    pick_worker,
)

M = ModelName("m")
CHAT = Endpoint.CHAT
SERVES_M = frozenset({(M, CHAT), (M, Endpoint.COMPLETIONS)})


def w(
    id_: str,
    running: int = 0,
    slots: int = 4,
    ready: bool = True,
    models: frozenset[tuple[ModelName, Endpoint]] = SERVES_M,
    last: float = 0.0,
    loaded: bool = True,
) -> WorkerLoad:
    return WorkerLoad(WorkerId(id_), ready, models, slots, running, last, loaded)


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        ([], None),
        ([w("a")], "a"),
        ([w("a", running=4)], None),  # full
        ([w("a", ready=False)], None),  # loading or restarting
        ([w("a", models=frozenset({(ModelName("other"), CHAT)}))], None),
        ([w("a", models=frozenset({(M, Endpoint.EMBEDDINGS)}))], None),  # wrong endpoint
        ([w("a", running=2), w("b", running=1)], "b"),  # least loaded
        ([w("a", running=1, slots=2), w("b", running=1, slots=4)], "b"),  # by fraction
        ([w("a", last=5.0), w("b", last=3.0)], "b"),  # tie: idle the longest
        ([w("b"), w("a")], "a"),  # full tie: by id, whatever the order
        ([w("a", running=4), w("b", ready=False), w("c", running=3)], "c"),
        ([w("a", loaded=False)], "a"),  # unloaded after idling: takes the job and loads
        ([w("a", loaded=False), w("b", running=3)], "b"),  # loaded beats idle-unloaded
        ([w("a", loaded=False), w("b", running=4)], "a"),  # unless the loaded one is full
    ],
)
def test_pick_worker_table(workers: list[WorkerLoad], expected: str | None) -> None:
    assert pick_worker(workers, M, CHAT) == expected


loads = st.builds(
    w,
    id_=st.text("abcdef", min_size=1, max_size=3),
    running=st.integers(0, 8),
    slots=st.integers(1, 8),
    ready=st.booleans(),
    last=st.floats(0, 100),
    loaded=st.booleans(),
)


@given(st.lists(loads, max_size=8, unique_by=lambda x: x.id))
def test_pick_worker_properties(workers: list[WorkerLoad]) -> None:
    chosen = pick_worker(workers, M, CHAT)
    eligible = [x for x in workers if x.ready and x.running < x.slots]
    if not eligible:
        assert chosen is None
        return
    picked = next(x for x in workers if x.id == chosen)
    assert picked in eligible
    if any(x.loaded for x in eligible):
        assert picked.loaded, "a loaded worker is always preferred to an unloaded one"
        eligible = [x for x in eligible if x.loaded]
    assert picked.running / picked.slots == min(x.running / x.slots for x in eligible)
    assert pick_worker(list(reversed(workers)), M, CHAT) == chosen


# ---------------------------------------------------------------- prefix routing

CHAIN = tuple(range(100, 120))  # a request's 20-block prefix chain (~1,280 tokens)
HOT = frozenset(CHAIN)
HALF = frozenset(CHAIN[:10])
SHORT = frozenset(CHAIN[:1])  # one block: a template header, ~64 tokens


def c(id_: str, running: int = 0, cached: frozenset[int] = frozenset(), **kw: bool) -> WorkerLoad:
    return WorkerLoad(WorkerId(id_), kw.get("ready", True), SERVES_M, 4, running, 0.0, True, cached)


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        ([c("a"), c("b", cached=HOT)], "b"),  # the worker holding the prefix
        ([c("a"), c("b", running=3, cached=HOT)], "b"),  # even busy, while a slot is free
        ([c("a"), c("b", running=4, cached=HOT)], "a"),  # full: spills over
        ([c("a", cached=HALF), c("b", cached=HOT)], "b"),  # the longest prefix wins
        ([c("a", running=1, cached=HALF), c("b", running=3, cached=HOT)], "b"),
        ([c("a"), c("b", running=2, cached=SHORT)], "a"),  # a short match loses to load
        ([c("a", running=1), c("b", running=1, cached=SHORT)], "b"),  # but breaks a tie
        ([c("a", cached=HOT, ready=False), c("b")], "b"),  # a restarting worker is skipped
        ([c("a", cached=frozenset(CHAIN[1:])), c("b", running=1)], "a"),  # no first block
    ],
)
def test_pick_worker_by_prefix(workers: list[WorkerLoad], expected: str) -> None:
    assert pick_worker(workers, M, CHAT, CHAIN) == expected


def test_without_a_prefix_held_blocks_are_ignored() -> None:
    """``--routing least-loaded`` passes no prefix: the least loaded wins whatever it holds."""
    assert pick_worker([c("a"), c("b", running=1, cached=HOT)], M, CHAT) == "a"


cached_loads = st.builds(
    c,
    id_=st.text("abcdef", min_size=1, max_size=3),
    running=st.integers(0, 4),
    cached=st.integers(0, len(CHAIN)).map(lambda n: frozenset(CHAIN[:n])),
    ready=st.booleans(),
)


@given(st.lists(cached_loads, max_size=6, unique_by=lambda x: x.id))
def test_prefix_routing_properties(workers: list[WorkerLoad]) -> None:
    chosen = pick_worker(workers, M, CHAT, CHAIN)
    eligible = [x for x in workers if x.ready and x.running < x.slots]
    if not eligible:
        assert chosen is None  # the job waits only when every worker is full
        return
    assert chosen is not None, "no worker idles while a job waits"
    picked = next(x for x in workers if x.id == chosen)
    assert picked in eligible

    def worth(x: WorkerLoad) -> float:
        return expected_reuse(x, CHAIN) - LOAD_COST_TOKENS * x.running / x.slots

    assert worth(picked) == max(worth(x) for x in eligible)
    if any(len(x.cached) == len(CHAIN) for x in eligible):
        # a hot prefix stays where it is held while a slot is free: at worst it goes to a
        # less busy worker holding nearly all of it, never to one holding little
        slack = LOAD_COST_TOKENS // expected_tokens(1)
        assert len(picked.cached) >= len(CHAIN) - slack
    assert pick_worker(list(reversed(workers)), M, CHAT, CHAIN) == chosen


# ---------------------------------------------------------------- several routers: holds


@pytest.mark.parametrize(
    ("owned", "expected"),
    [
        ([], None),
        ([("r1", c("a")), ("r2", c("b"))], None),  # nobody holds the prefix: anyone's
        ([("r1", c("a")), ("r2", c("b", cached=HOT))], "r2"),  # held behind router r2
        ([("r1", c("a", cached=HOT)), ("r2", c("b"))], "r1"),  # or this router's own
        ([("r1", c("a")), ("r2", c("b", running=3, cached=HOT))], "r2"),  # busy, a slot free
        ([("r1", c("a")), ("r2", c("b", running=4, cached=HOT))], None),  # full: never held
        ([("r1", c("a")), ("r2", c("b", cached=HOT, ready=False))], None),  # restarting
        ([("r1", c("a")), ("r2", c("b", cached=SHORT))], None),  # too little to wait for
        ([("r1", c("a", cached=HALF)), ("r2", c("b", cached=HOT))], "r2"),  # the longest
        # a pull worker claims its own jobs: the job is held for it, by its consumer name
        ([("r1", c("a")), ("worker-p", c("p", cached=HOT))], "worker-p"),
        ([("worker-p", c("p", cached=HALF)), ("worker-q", c("q", cached=HOT))], "worker-q"),
        ([("r1", c("a", running=2, cached=HOT)), ("worker-p", c("p", cached=HOT))], "worker-p"),
        ([("r1", c("a", cached=HOT)), ("worker-p", c("p", running=2, cached=HOT))], "r1"),
        ([("r1", c("a")), ("worker-p", c("p", running=4, cached=HOT))], None),  # full
        ([("r1", c("a")), ("worker-p", c("p", cached=SHORT))], None),  # too little
    ],
)
def test_hold_for_table(owned: list[tuple[str, WorkerLoad]], expected: str | None) -> None:
    assert hold_for(owned, M, CHAT, CHAIN) == expected


def test_no_prefix_is_never_held() -> None:
    assert hold_for([("r2", c("b", cached=HOT))], M, CHAT, ()) is None


@given(
    st.lists(
        st.tuples(st.sampled_from(["r1", "r2", "r3", "worker-p", "worker-q"]), cached_loads),
        max_size=6,
        unique_by=lambda x: x[1].id,
    )
)
def test_hold_for_properties(owned: list[tuple[str, WorkerLoad]]) -> None:
    router = hold_for(owned, M, CHAT, CHAIN)
    chosen = pick_worker([w for _, w in owned], M, CHAT, CHAIN)
    if router is None:
        # anyone's: no worker can take it, or the one the scheduler picks gains too little
        assert (
            chosen is None
            or expected_reuse(next(w for _, w in owned if w.id == chosen), CHAIN) < MIN_HOLD_TOKENS
        )
        return
    # held only for the router of the worker the scheduler would pick over the whole
    # cluster, which has a slot free and holds enough of the prefix: so a held job never
    # waits for a worker that cannot take it at once
    owner, worker = next((o, w) for o, w in owned if w.id == chosen)
    assert router == owner
    assert worker.ready and worker.running < worker.slots
    assert expected_reuse(worker, CHAIN) >= MIN_HOLD_TOKENS
    assert hold_for(list(reversed(owned)), M, CHAT, CHAIN) == router


# ---------------------------------------------------------------- context per slot


def x(id_: str, context: int | None, running: int = 0, slots: int = 1) -> WorkerLoad:
    """A worker serving ``M`` with ``context`` tokens per slot (None: it does not say)."""
    contexts = () if context is None else ((M, context),)
    return WorkerLoad(WorkerId(id_), True, SERVES_M, slots, running, contexts=contexts)


@pytest.mark.parametrize(
    ("workers", "need", "expected"),
    [
        ([x("small", 2048), x("big", 4096)], 3600, "big"),  # only the larger one holds it
        ([x("small", 2048), x("big", 4096, running=1)], 3600, None),  # it waits for it
        ([x("small", 2048), x("big", 4096)], 2048, "big"),  # both hold it: by id
        ([x("small", 2048), x("big", 4096, running=1)], 2048, "small"),  # the free one
        ([x("small", 2048)], 2049, None),
        ([x("small", 2048), x("attached", None)], 3600, "attached"),  # it may hold anything
        ([x("small", 2048)], 0, "small"),  # a request that needs no context
        # another model's context says nothing of this one's
        (
            [WorkerLoad(WorkerId("o"), True, SERVES_M, 1, 0, contexts=((ModelName("o"), 99),))],
            3600,
            "o",
        ),
    ],
)
def test_pick_worker_by_context(workers: list[WorkerLoad], need: int, expected: str | None) -> None:
    assert pick_worker(workers, M, CHAT, (), need) == expected


def test_a_job_is_not_held_for_a_worker_too_small_for_it() -> None:
    small = WorkerLoad(WorkerId("s"), True, SERVES_M, 4, 0, cached=HOT, contexts=((M, 2048),))
    owned = [("r1", c("a")), ("r2", small)]
    assert hold_for(owned, M, CHAT, CHAIN) == "r2"
    assert hold_for(owned, M, CHAT, CHAIN, need=3000) is None  # r1's worker says nothing


context_loads = st.builds(
    x,
    id_=st.text("abcdef", min_size=1, max_size=3),
    context=st.one_of(st.none(), st.sampled_from([512, 1024, 2048, 4096])),
    running=st.integers(0, 2),
    slots=st.integers(1, 2),
)


@given(st.lists(context_loads, max_size=6, unique_by=lambda w: w.id), st.integers(0, 5000))
def test_pick_worker_never_sends_a_job_where_its_context_does_not_fit(
    workers: list[WorkerLoad], need: int
) -> None:
    chosen = pick_worker(workers, M, CHAT, (), need)
    fitting = [w for w in workers if w.running < w.slots and w.fits(M, need)]
    if not fitting:
        assert chosen is None  # it waits (or, for no worker at all, the router refused it)
        return
    picked = next(w for w in workers if w.id == chosen)
    assert picked in fitting, "a job goes only where its need fits, and never idles there"
    assert all(n >= need for _, n in picked.contexts)


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        ([], 0),
        ([x("small", 2048), x("big", 4096)], 4096),
        ([x("small", 2048), x("big", 4096, running=1)], 2048),  # free slots only: big waits
        ([x("small", 2048, running=1), x("big", 4096, running=1)], 4096),  # none free: all
        ([x("small", 2048), x("attached", None)], 0),  # one that does not say takes any
    ],
)
def test_claim_limit(workers: list[WorkerLoad], expected: int) -> None:
    assert claim_limit(workers, M, CHAT) == expected
