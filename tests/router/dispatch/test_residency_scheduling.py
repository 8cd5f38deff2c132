"""pick_worker by residency: workers serving several text models, each with its own state,
slots and bytes. A table of cases, a ping-pong of two workers by two models, and a property
over random clusters: no eviction of a recently used model while another worker could take
the job without one."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.protocol.ids import ModelName, WorkerId
from shoal.protocol.messages import (
    BackendState,
    Endpoint,
    JobResult,
    JobStart,
    ModelInfo,
    decode_router_message,
)
from shoal.router.dispatch.job import JobState, Submission
from shoal.router.dispatch.scheduler import (
    THRASH_WINDOW_S,
    ModelLoad,
    Residency,
    WorkerLoad,
    choose,
    claim_limit,
    hold_for,
    pick_worker,
    residency_of,
)
from shoal.router.dispatch.workers import WorkerConnection
from shoal.router.errors import ModelDoesNotFit
from socketless import memory_dispatcher, worker_connection

A, B, C = ModelName("a"), ModelName("b"), ModelName("c")
CHAT = Endpoint.CHAT
READY, UNLOADED, LOADING = BackendState.READY, BackendState.UNLOADED, BackendState.LOADING
GB = 1 << 30


def m(
    name: ModelName,
    state: BackendState = UNLOADED,
    running: int = 0,
    size: int = 4 * GB,
    pinned: bool = False,
    last: float = 0.0,
    slots: int | None = 2,
) -> ModelLoad:
    return ModelLoad(name, state, slots, running, size, pinned, last)


def w(id_: str, *models: ModelLoad, budget: int | None = 6 * GB, slots: int = 4) -> WorkerLoad:
    """A worker serving ``models`` (each its own state) with room for ``budget`` bytes."""
    return WorkerLoad(
        WorkerId(id_),
        ready=True,
        models=frozenset((x.name, CHAT) for x in models),
        slots=slots,
        running=sum(x.running for x in models),
        residency=models,
        budget=budget,
    )


NOW = 1000.0
OLD = NOW - THRASH_WINDOW_S - 1  # assigned past the window
RECENT = NOW - 1.0


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        # resident with a free slot beats loading anywhere
        ([w("x", m(A)), w("y", m(A, READY))], "y"),
        # ... however busy, while it has a slot of its own free
        ([w("x", m(A)), w("y", m(A, READY, running=1))], "y"),
        # its own slots full: the worker's slots do not count for it
        ([w("y", m(A, READY, running=2), slots=8)], None),
        # resident full, another loads it into free memory: load there
        ([w("x", m(A, READY, running=2)), w("y", m(A))], "y"),
        # resident full, the other would have to evict: wait for the resident one
        ([w("x", m(A, READY, running=2)), w("y", m(A), m(B, READY, last=OLD))], None),
        # loading already beats a fresh load
        ([w("x", m(A)), w("y", m(A, LOADING))], "y"),
        # nowhere resident: free memory beats an eviction
        ([w("x", m(A), m(B, READY, last=OLD)), w("y", m(A))], "y"),
        # only evictions: the least recently used goes
        ([w("x", m(A), m(B, READY, last=RECENT)), w("y", m(A), m(C, READY, last=OLD))], "y"),
        # a model with a running job is never evicted
        ([w("x", m(A), m(B, READY, running=1))], None),
        # nor a pinned one
        ([w("x", m(A), m(B, READY, pinned=True))], None),
        # a model too big for the budget, even alone: no candidate
        ([w("x", m(A, size=7 * GB))], None),
        # an eviction of a model idle past the window beats one of a recent model
        ([w("x", m(A), m(B, READY, last=RECENT)), w("y", m(A), m(C, READY, last=OLD))], "y"),
        # two fit beside each other: no eviction
        ([w("x", m(A, size=2 * GB), m(B, READY, size=2 * GB, last=RECENT))], "x"),
        # a worker that says no budget decides itself: a plain load
        ([w("x", m(A), m(B, READY), budget=None)], "x"),
    ],
)
def test_residency_table(workers: list[WorkerLoad], expected: str | None) -> None:
    assert pick_worker(workers, A, CHAT, now=NOW) == expected


def test_residency_names_what_a_load_evicts() -> None:
    worker = w("x", m(A), m(B, READY, last=OLD, size=3 * GB), m(C, READY, last=RECENT, size=2 * GB))
    assert residency_of(worker, A) == (Residency.EVICTS, ("b",))
    chosen = choose([worker], A, CHAT, now=NOW)
    assert chosen is not None and chosen.evict == ("b",)


def test_single_model_workers_rank_as_before() -> None:
    """No state of its own: the worker's state and slots (idle-unloaded loads again)."""
    plain = frozenset({(A, CHAT)})
    loaded = WorkerLoad(WorkerId("l"), True, plain, 2, 2, loaded=True)
    unloaded = WorkerLoad(WorkerId("u"), True, plain, 2, 0, loaded=False)
    assert pick_worker([loaded, unloaded], A, CHAT) == "u"
    assert pick_worker([replace(loaded, running=1), unloaded], A, CHAT) == "l"


def test_free_slots_count_each_models_own() -> None:
    worker = w("x", m(A, READY, running=2), m(B, READY, running=1), slots=3)
    assert worker.free_slots() == 1
    assert worker.free_for(B) and not worker.free_for(A)
    shared = WorkerLoad(WorkerId("s"), True, frozenset({(A, CHAT)}), 4, 1)
    assert shared.free_slots() == 3


def test_claim_limit_counts_a_models_own_slots() -> None:
    full = replace(w("x", m(A, READY, running=2)), contexts=((A, 1000),))
    free = replace(w("y", m(A, READY)), contexts=((A, 4000),))
    other_full = replace(w("z", m(A, READY, running=2)), contexts=((A, 9000),))
    assert claim_limit([full, free, other_full], A, CHAT) == 4000


def test_hold_for_the_router_where_the_model_is_resident() -> None:
    """With Redis: a job waits for the router whose worker has its model resident, rather
    than another router's worker loading it; not when every worker has it resident."""
    resident = w("x", m(A, READY))
    loads = w("y", m(A))
    assert hold_for([("r1", loads), ("r2", resident)], A, CHAT, ()) == "r2"
    assert hold_for([("r1", w("y", m(A, READY))), ("r2", resident)], A, CHAT, ()) is None
    full = w("x", m(A, READY, running=2))
    assert hold_for([("r1", loads), ("r2", full)], A, CHAT, ()) is None  # never for a full one


# ---------------------------------------------------------------- no thrash


def _run(workers: list[WorkerLoad], model: ModelName, now: float) -> tuple[list[WorkerLoad], bool]:
    """Place one job of ``model`` and apply the load it asks for (the job then ends); whether
    that evicted a model given a job within the window."""
    chosen = choose(workers, model, CHAT, now=now)
    assert chosen is not None, f"no worker for {model}"
    after: list[WorkerLoad] = []
    thrash = False
    for worker in workers:
        if worker.id != chosen.worker:
            after.append(worker)
            continue
        models = []
        for x in worker.residency:
            if x.name in chosen.evict:
                thrash |= now - x.last_assigned < THRASH_WINDOW_S
                models.append(replace(x, state=UNLOADED))
            elif x.name == model:
                models.append(replace(x, state=READY, last_assigned=now))
            else:
                models.append(x)
        after.append(replace(worker, residency=tuple(models), last_assigned=now))
    return after, thrash


def test_two_workers_two_models_never_ping_pong() -> None:
    """Each worker holds one model; jobs alternate a, b, a, b: each model settles on a worker
    and stays there (one load each, no eviction at all)."""
    workers = [w(i, m(A), m(B)) for i in ("x", "y")]
    loads = 0
    for step in range(40):
        model = (A, B)[step % 2]
        before = workers
        workers, thrash = _run(workers, model, NOW + step)
        assert not thrash
        loads += sum(
            1
            for old, new in zip(before, workers, strict=True)
            for o, n in zip(old.residency, new.residency, strict=True)
            if o.state is not READY and n.state is READY
        )
    assert loads == 2
    homes = {x.name: wk.id for wk in workers for x in wk.residency if x.state is READY}
    assert homes.keys() == {"a", "b"} and homes["a"] != homes["b"]


MODELS = (A, B, C)


@st.composite
def clusters(draw: st.DrawFn) -> list[WorkerLoad]:
    workers = []
    for i in range(draw(st.integers(1, 3))):
        models = []
        for name in MODELS:
            state = draw(st.sampled_from((READY, UNLOADED, LOADING)))
            running = draw(st.integers(0, 2)) if state is READY else 0
            models.append(
                m(
                    name,
                    state,
                    running,
                    size=draw(st.integers(1, 4)) * GB,
                    pinned=draw(st.booleans()),
                    last=draw(st.sampled_from((0.0, OLD, RECENT))),
                )
            )
        workers.append(w(f"w{i}", *models, budget=draw(st.integers(2, 8)) * GB))
    return workers


@given(clusters(), st.sampled_from(MODELS))
def test_no_eviction_of_a_recent_model_while_another_worker_could_take_it(
    workers: list[WorkerLoad], model: ModelName
) -> None:
    chosen = choose(workers, model, CHAT, now=NOW)
    if chosen is None:
        return
    chosen_worker = next(x for x in workers if x.id == chosen.worker)
    recent = [
        x.name
        for x in chosen_worker.residency
        if x.name in chosen.evict and NOW - x.last_assigned < THRASH_WINDOW_S
    ]
    for x in chosen_worker.residency:  # admit's rule: never pinned, never busy
        if x.name in chosen.evict:
            assert not x.pinned and x.running == 0 and x.state is READY
    if not recent:
        return
    for other in workers:
        how = residency_of(other, model)
        if other.id == chosen.worker or how is None:
            continue
        evicted = {x.name: x for x in other.residency if x.name in how[1]}
        assert any(NOW - x.last_assigned < THRASH_WINDOW_S for x in evicted.values()), (
            f"{chosen.worker} evicts recent {recent} while {other.id} could evict {how[1]}"
        )


# ---------------------------------------------------------------- through the dispatcher


def _text(name: ModelName, state: BackendState) -> ModelInfo:
    return ModelInfo(name=name, endpoints=(CHAT,), state=state, slots=1, resident_bytes=4 * GB)


def _starts(worker: WorkerConnection) -> list[JobStart]:
    out = []
    while not worker.outbox.empty():
        msg = decode_router_message(worker.outbox.get_nowait())
        if isinstance(msg, JobStart):
            out.append(msg)
    return out


def test_the_dispatcher_waits_for_the_resident_worker_rather_than_evict() -> None:
    """In-process: a's one slot on x is busy; y could load a only by evicting b (given a job
    just now): the second job of a waits for x, and takes x's slot when the first ends."""
    dispatcher = memory_dispatcher()
    x = worker_connection("x", [_text(A, READY), _text(B, UNLOADED)], model_budget_bytes=6 * GB)
    y = worker_connection("y", [_text(A, UNLOADED), _text(B, READY)], model_budget_bytes=6 * GB)
    for worker in (x, y):
        dispatcher.workers.on_registered(worker)
    b_job = dispatcher.submit(Submission(B, CHAT, False, {"messages": []}))
    assert b_job.worker_id == "y"
    dispatcher.workers.on_message(y, JobResult(job_id=b_job.id, body="{}"))  # b idle now
    first = dispatcher.submit(Submission(A, CHAT, False, {"messages": []}))
    second = dispatcher.submit(Submission(A, CHAT, False, {"messages": []}))
    assert first.worker_id == "x" and second.state is JobState.QUEUED
    dispatcher.workers.on_message(x, JobResult(job_id=first.id, body="{}"))
    assert second.worker_id == "x"
    assert [s.job_id for s in _starts(x)] == [first.id, second.id]
    assert [s.model for s in _starts(y)] == [B]


def test_a_model_a_job_is_loading_is_neither_evicted_nor_counted_free() -> None:
    """A job placed where its model is not loaded loads it: until the worker reports that,
    the router takes the model as loading there. A second job of it joins that load; a job
    of another model does not evict it (it loads elsewhere, into free memory)."""
    dispatcher = memory_dispatcher()
    x = worker_connection("x", [_text(A, UNLOADED), _text(B, UNLOADED)], model_budget_bytes=6 * GB)
    y = worker_connection("y", [_text(B, UNLOADED)], model_budget_bytes=6 * GB)
    y.last_assigned = time.monotonic() + 3600  # else equal, y would lose the tie to x
    for worker in (x, y):
        dispatcher.workers.on_registered(worker)
    a_job = dispatcher.submit(Submission(A, CHAT, True, {"messages": []}))
    assert a_job.worker_id == "x"
    assert [m.state for m in x.load().residency] == [LOADING, UNLOADED]
    b_job = dispatcher.submit(Submission(B, CHAT, True, {"messages": []}))
    assert b_job.worker_id == "y"


def test_a_model_no_worker_could_ever_load_is_refused_at_once_with_its_numbers() -> None:
    """Every worker serving it refuses it for good (too big for one budget, not beside the
    pinned model of the other): the request is refused now, naming each worker's numbers,
    rather than waiting out --max-wait. One worker that could load it (after its jobs end)
    is enough to queue it."""
    dispatcher = memory_dispatcher()
    big = ModelInfo(name=A, endpoints=(CHAT,), state=UNLOADED, slots=1, resident_bytes=8 * GB)
    pinned = _text(B, READY).model_copy(update={"pinned": True})
    x = worker_connection("x", [big], model_budget_bytes=6 * GB)
    y = worker_connection(
        "y", [big.model_copy(update={"resident_bytes": 3 * GB}), pinned], model_budget_bytes=6 * GB
    )
    for worker in (x, y):
        dispatcher.workers.on_registered(worker)
    with pytest.raises(ModelDoesNotFit) as refused:
        dispatcher.submit(Submission(A, CHAT, False, {"messages": []}))
    message = str(refused.value)
    assert "worker x: model a needs 8.0 GiB" in message, message
    assert "worker y: model a needs 3.0 GiB" in message and "pinned" in message, message
    z = worker_connection("z", [_text(A, UNLOADED), _text(B, READY)], model_budget_bytes=6 * GB)
    dispatcher.workers.on_registered(z)
    assert dispatcher.submit(Submission(A, CHAT, False, {"messages": []})).worker_id == "z"
