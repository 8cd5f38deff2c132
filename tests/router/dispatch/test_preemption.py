"""The preemption decision (``router/dispatch/preemption.py``): tables and hypothesis."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from shoal.router.dispatch.preemption import (
    MAX_PREEMPTIONS,
    MIN_TOKENS,
    RunningJob,
    WaitingJob,
    choose_victim,
    shares,
)

TENANTS = ("a", "b", "c", "d")


def job(ref: int, tenant: str = "a", **kw: object) -> RunningJob:
    fields: dict[str, object] = {
        "weight": 1.0,
        "interactive": True,
        "tokens": 50,
        "started": float(ref),
        "resumable": True,
    }
    fields.update(kw)
    return RunningJob(ref, tenant, **fields)  # type: ignore[arg-type]  # (test table rows)


B = WaitingJob("b", 1.0, True)


def test_a_light_key_takes_a_slot_from_a_flood() -> None:
    running = [job(i) for i in range(4)]
    assert choose_victim(running, B, {"b": 1.0}, 4) is not None


def test_a_free_slot_is_used_without_pausing_anyone() -> None:
    assert choose_victim([job(i) for i in range(3)], B, {"b": 1.0}, 4) is None


def test_batch_work_never_pauses_anyone() -> None:
    batch = WaitingJob("b", 1.0, False)
    assert choose_victim([job(i) for i in range(4)], batch, {"b": 1.0}, 4) is None


def test_a_key_at_its_share_pauses_no_one() -> None:
    running = [job(0), job(1), job(2, "b"), job(3, "b")]
    assert choose_victim(running, B, {"b": 1.0}, 4) is None
    # three slots: a holds 2 of its 1.5, b 1 of its 1.5; b taking one would swap the imbalance
    running = [job(0), job(1), job(2, "b")]
    assert choose_victim(running, B, {"b": 1.0}, 3) is None


def test_weights_set_the_shares() -> None:
    running = [job(0), job(1), job(2), job(3, "b")]
    # b's weight 3 of 4: a share of 3 slots; it holds 1
    assert choose_victim(running, WaitingJob("b", 3.0, True), {"b": 3.0}, 4) is not None
    # a's weight 3 of 4: a holds 3, its share; b at weight 1 has its one slot
    heavy = [job(i, weight=3.0) for i in range(3)] + [job(3, "b")]
    assert choose_victim(heavy, B, {"b": 1.0}, 4) is None


def test_only_answers_that_can_go_on_and_have_run_a_little_are_paused() -> None:
    assert choose_victim([job(0, resumable=False)], B, {"b": 1.0}, 1) is None
    assert choose_victim([job(0, tokens=MIN_TOKENS - 1)], B, {"b": 1.0}, 1) is None
    assert choose_victim([job(0, preemptions=MAX_PREEMPTIONS)], B, {"b": 1.0}, 1) is None
    assert choose_victim([job(0, tokens=MIN_TOKENS)], B, {"b": 1.0}, 1) is not None


def test_one_slot_goes_to_the_key_that_holds_none_and_is_not_taken_back() -> None:
    assert choose_victim([job(0)], B, {"b": 1.0}, 1) is not None
    taken = job(1, "b", took_slot=True)
    assert choose_victim([taken], WaitingJob("a", 1.0, True), {"a": 1.0}, 1) is None


def test_the_victim_is_batch_first_then_the_fewest_tokens_then_the_last_started() -> None:
    running = [job(0, tokens=10), job(1, tokens=90, interactive=False), job(2, tokens=90)]
    assert choose_victim(running, B, {"b": 1.0}, 3) == running[1]
    running = [job(0, tokens=40), job(1, tokens=20), job(2, tokens=20), job(3, tokens=30)]
    assert choose_victim(running, B, {"b": 1.0}, 4) == running[2]


running_jobs = st.lists(
    st.builds(
        RunningJob,
        ref=st.integers(),
        tenant=st.sampled_from(TENANTS),
        weight=st.sampled_from([0.5, 1.0, 2.0, 3.0]),
        interactive=st.booleans(),
        tokens=st.integers(0, 200),
        started=st.floats(0, 100),
        resumable=st.booleans(),
        preemptions=st.integers(0, 2),
        took_slot=st.booleans(),
    ),
    max_size=12,
)
waiting_jobs = st.builds(
    WaitingJob,
    tenant=st.sampled_from(TENANTS),
    weight=st.sampled_from([0.5, 1.0, 2.0, 3.0]),
    interactive=st.booleans(),
)


def consistent(
    running: list[RunningJob], head: WaitingJob
) -> tuple[list[RunningJob], dict[str, float]]:
    """One weight per tenant (a tenant's weight is its key's), refs unique."""
    weight = {head.tenant: head.weight}
    out = []
    for i, r in enumerate(running):
        w = weight.setdefault(r.tenant, r.weight)
        out.append(
            RunningJob(
                i,
                r.tenant,
                w,
                r.interactive,
                r.tokens,
                r.started,
                r.resumable,
                r.preemptions,
                r.took_slot,
            )
        )
    return out, weight


@given(running_jobs, waiting_jobs, st.integers(0, 4))
def test_a_victim_obeys_every_rule(jobs: list[RunningJob], head: WaitingJob, spare: int) -> None:
    running, weight = consistent(jobs, head)
    slots = len(running) + (spare if spare < 2 else 0)  # sometimes a slot is free
    waiting = {head.tenant: head.weight}
    victim = choose_victim(running, head, waiting, slots)
    if victim is None:
        return
    assert victim in running
    assert len(running) == slots, "a slot was free: nothing may be paused"
    assert head.interactive
    assert victim.resumable and victim.tokens >= MIN_TOKENS
    assert victim.preemptions < MAX_PREEMPTIONS and not victim.took_slot
    held = Counter(r.tenant for r in running)
    share = shares({t: weight[t] for t in {*held, head.tenant}}, slots)
    mine = held[head.tenant]
    assert mine < share[head.tenant]
    assert held[victim.tenant] > share[victim.tenant]
    assert mine == 0 or (mine + 1) / head.weight < held[victim.tenant] / weight[victim.tenant]
    assert victim.tenant != head.tenant
    # batch first, then fewest tokens, then last started, among the jobs that may be paused
    others = [
        r
        for r in running
        if r.tenant != head.tenant
        and held[r.tenant] > share[r.tenant]
        and (mine == 0 or (mine + 1) / head.weight < held[r.tenant] / weight[r.tenant])
        and not r.took_slot
        and r.resumable
        and r.tokens >= MIN_TOKENS
        and r.preemptions < MAX_PREEMPTIONS
    ]
    assert all(
        (victim.interactive, victim.tokens, -victim.started)
        <= (r.interactive, r.tokens, -r.started)
        for r in others
    )


@given(running_jobs, waiting_jobs)
def test_no_ping_pong(jobs: list[RunningJob], head: WaitingJob) -> None:
    """After a job of tenant X takes a slot from tenant Y, a waiting job of Y never takes it
    back from X: X is within its share."""
    running, weight = consistent(jobs, head)
    slots = len(running)
    victim = choose_victim(running, head, {head.tenant: head.weight}, slots)
    if victim is None:
        return
    taken = RunningJob(-1, head.tenant, head.weight, True, MIN_TOKENS, 1e9, True, 0, True)
    after = [r for r in running if r != victim] + [taken]
    back = WaitingJob(victim.tenant, victim.weight, True)
    again = choose_victim(after, back, {victim.tenant: victim.weight}, slots)
    assert again is None or again.tenant != head.tenant


@given(running_jobs, waiting_jobs)
def test_repeated_preemption_ends(jobs: list[RunningJob], head: WaitingJob) -> None:
    """Jobs of one tenant keep arriving: each pause moves a slot to it, and it stops at its
    share (at most ``slots`` pauses)."""
    running, _ = consistent(jobs, head)
    slots = len(running)
    for n in range(slots + 1):
        victim = choose_victim(running, head, {head.tenant: head.weight}, slots)
        if victim is None:
            return
        assert n < slots
        taken = RunningJob(-2 - n, head.tenant, head.weight, True, 0, 1e9, True, 0, True)
        running = [r for r in running if r != victim] + [taken]
