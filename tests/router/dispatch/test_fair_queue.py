"""Start-time fair queueing between tenants: tables for the rules, hypothesis for the bound."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.router.dispatch.fair_queue import FairQueue, Priority, QueueFull, Tenant

A, B, C = Tenant("a"), Tenant("b"), Tenant("c")


def drain(queue: FairQueue[str], now: float = 0.0) -> list[str]:
    order = []
    while (job := queue.peek(now)) is not None:
        queue.pop(job)
        order.append(job)
    return order


def test_a_light_tenant_goes_ahead_of_a_flood() -> None:
    q: FairQueue[str] = FairQueue(100)
    for i in range(20):
        q.push(f"a{i}", A, 100, now=0)
    q.push("b0", B, 100, now=1)
    assert q.position("b0", now=1) == 1  # behind a0 only: both start at V = 0
    assert drain(q)[:2] == ["a0", "b0"]


def test_a_job_dispatched_without_waiting_is_charged_to_its_tenant() -> None:
    q: FairQueue[str] = FairQueue(100)
    q.charge(A, 100)  # a0 went straight to a free slot
    q.push("a1", A, 100, now=0)
    q.push("b0", B, 100, now=0)
    assert drain(q) == ["b0", "a1"]


def test_alone_a_tenant_is_served_in_order_and_fifo_mode_ignores_tenants() -> None:
    q: FairQueue[str] = FairQueue(100)
    for i in range(5):
        q.push(f"a{i}", A, 10 * (i + 1), now=0)
    assert drain(q) == [f"a{i}" for i in range(5)]
    fifo: FairQueue[str] = FairQueue(100, fair=False)
    for job, tenant in (("a0", A), ("a1", A), ("b0", B), ("a2", A)):
        fifo.push(job, tenant, 10, now=0)
    assert drain(fifo) == ["a0", "a1", "b0", "a2"]


def test_weights_share_work_not_requests() -> None:
    q: FairQueue[str] = FairQueue(1000)
    heavy = Tenant("heavy", weight=3.0)
    for i in range(40):
        q.push(f"h{i}", heavy, 10, now=0)
        q.push(f"l{i}", A, 10, now=0)
    first = drain(q)[:40]
    assert sum(j.startswith("h") for j in first) == 30  # 3:1 while both wait


def test_waiting_counts_a_tenants_jobs_of_both_classes_until_they_leave() -> None:
    q: FairQueue[str] = FairQueue(100)
    batch_a = Tenant("a", priority=Priority.BATCH)  # its async jobs: the same tenant id
    assert q.waiting("a") == 0
    q.push("a0", A, 10, now=0)
    q.push("a1", batch_a, 10, now=0)
    q.push("b0", B, 10, now=0)
    assert (q.waiting("a"), q.waiting("b"), q.waiting("c")) == (2, 1, 0)
    q.pop("a0")
    q.remove("a1")
    q.push_front("b1", B, 10, now=1)  # a job put back waits again
    assert (q.waiting("a"), q.waiting("b")) == (0, 2)
    assert drain(q) == ["b1", "b0"] and q.waiting("b") == 0


def test_batch_waits_for_interactive_until_it_has_aged() -> None:
    batch = Tenant("a", priority=Priority.BATCH)
    q: FairQueue[str] = FairQueue(100, batch_aging_s=30)
    q.push("batch", batch, 10, now=0)
    q.push("chat", B, 10_000, now=1)
    assert q.peek(now=1) == "chat" and q.position("batch", now=1) == 1
    assert q.peek(now=30) == "batch"  # aged: as interactive, and its start tag is older


@pytest.mark.parametrize("fair", [True, False])
def test_in_order_per_tenant_with_a_bound_and_requeue_at_front(fair: bool) -> None:
    """What the plain FIFO queue this replaced did, in both modes."""
    q: FairQueue[str] = FairQueue(2, fair=fair)
    other: FairQueue[str] = FairQueue(2, fair=fair)  # another (model, endpoint): its own bound
    q.push("a", A, 10, now=0)
    q.push("b", A, 10, now=0)
    other.push("o", A, 10, now=0)
    with pytest.raises(QueueFull):
        q.push("c", A, 10, now=0)
    assert q.peek(0) == "a"
    q.pop("a")
    q.push_front("a", A, 10, now=1)  # a job whose worker was lost goes back first
    assert list(q.jobs()) == ["b", "a"] and q.peek(1) == "a"
    assert q.remove("b") and not q.remove("b")
    assert len(q) == 1 and len(other) == 1


def test_a_job_put_back_goes_first_and_the_cap_holds() -> None:
    q: FairQueue[str] = FairQueue(2)
    q.push("a0", A, 10, now=0)
    q.push("b0", B, 10, now=0)
    with pytest.raises(QueueFull):
        q.push("c0", C, 10, now=0)
    q.pop("a0")
    q.push_front("a0", A, 10, now=1)  # lost its worker
    assert q.peek(now=1) == "a0" and q.remove("b0") and not q.remove("b0")
    assert len(q) == 1


def test_settling_a_job_that_did_less_work_than_charged_brings_its_tenant_forward() -> None:
    q: FairQueue[str] = FairQueue(100)
    q.push("a0", A, 1000, now=0)
    q.push("b0", B, 10, now=0)
    assert q.peek(0) == "a0"
    q.pop("a0")
    q.settle(A, estimated=1000, actual=10)  # it stopped early
    q.push("a1", A, 10, now=1)
    q.push("b1", B, 10, now=1)
    assert drain(q, now=1) == ["b0", "a1", "b1"]


tenants = st.lists(
    st.tuples(st.floats(0.5, 8.0), st.lists(st.integers(1, 2000), min_size=30, max_size=60)),
    min_size=2,
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(tenants=tenants, dispatched=st.integers(1, 30))
def test_backlogged_tenants_get_their_weighted_share_within_the_sfq_bound(
    tenants: list[tuple[float, list[int]]], dispatched: int
) -> None:
    """Every tenant stays backlogged (more jobs than are dispatched): after any number of
    dispatches, |W_i/w_i - W_j/w_j| <= c_i/w_i + c_j/w_j (c: the tenant's largest cost)."""
    q: FairQueue[tuple[int, int]] = FairQueue(10_000)
    weight = {}
    largest = {}
    rounds = max(len(costs) for _, costs in tenants)
    for r in range(rounds):  # arrivals interleaved, as clients would send them
        for t, (w, costs) in enumerate(tenants):
            if r < len(costs):
                q.push((t, r), Tenant(str(t), weight=w), costs[r], now=0)
        # nothing dispatched yet: tags depend only on arrival order within a tenant
    for t, (w, costs) in enumerate(tenants):
        weight[t], largest[t] = w, max(costs)
    served: dict[int, float] = defaultdict(float)
    for _ in range(dispatched):
        job = q.peek(0)
        assert job is not None  # work-conserving
        q.pop(job)
        served[job[0]] += tenants[job[0]][1][job[1]]
        for i in weight:
            for j in weight:
                gap = abs(served[i] / weight[i] - served[j] / weight[j])
                assert gap <= largest[i] / weight[i] + largest[j] / weight[j] + 1e-6


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("push"), st.integers(0, 3), st.integers(1, 500)),
            st.tuples(st.just("pop"), st.just(0), st.just(0)),
            st.tuples(st.just("remove"), st.integers(0, 50), st.just(0)),
        ),
        max_size=80,
    )
)
def test_positions_count_down_to_the_next_job_and_nothing_is_lost_or_miscounted(
    ops: list[tuple[str, int, int]],
) -> None:
    q: FairQueue[int] = FairQueue(1000)
    pushed: set[int] = set()
    gone: set[int] = set()
    owner: dict[int, str] = {}
    for n, (op, arg, cost) in enumerate(ops):
        if op == "push":
            q.push(n, Tenant(str(arg)), cost, now=n)
            pushed.add(n)
            owner[n] = str(arg)
        elif op == "pop" and (job := q.peek(n)) is not None:
            q.pop(job)
            gone.add(job)
        elif op == "remove" and q.remove(arg):
            gone.add(arg)
        waiting = sorted(q.jobs())
        assert set(waiting) == pushed - gone
        for tenant in map(str, range(4)):  # what a key's queue cap counts
            assert q.waiting(tenant) == sum(owner[job] == tenant for job in waiting)
        positions = sorted(q.position(job, n) for job in waiting)
        assert positions == list(range(len(waiting)))  # a strict order over every job
        head = q.peek(n)
        assert (head is None) == (not waiting)  # work-conserving
        if head is not None:
            assert q.position(head, n) == 0
        # the order a worker that cannot take the head goes through: the places, in order
        assert [q.position(job, n) for job in q.ranked(n)] == list(range(len(waiting)))
