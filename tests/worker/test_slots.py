"""The worker's slot table: which slot a job takes, what each holds, waiting when full."""

from __future__ import annotations

import asyncio
import math

import pytest

from shoal.worker.slots import (
    PROMPT_S_PER_TOKEN,
    TOKEN_BLOCK,
    Slot,
    SlotTable,
    choose_slot,
    plan_slot,
    token_chain,
)

A = token_chain(list(range(10 * TOKEN_BLOCK)))
B = token_chain(list(range(1000, 1000 + 10 * TOKEN_BLOCK)))
A_THEN_MORE = token_chain(list(range(10 * TOKEN_BLOCK)) + [7] * 3 * TOKEN_BLOCK)


@pytest.mark.parametrize(
    ("slots", "prompt", "expected"),
    [
        ([Slot(0), Slot(1)], A, 0),  # nothing held: the lowest id
        ([Slot(0, A, last_used=2), Slot(1, B, last_used=1)], A_THEN_MORE, 0),  # its prefix
        ([Slot(0, A, last_used=1), Slot(1, B, last_used=2)], B, 1),
        ([Slot(0, A, last_used=2), Slot(1, B, last_used=1)], token_chain([5] * 64), 1),  # LRU
        ([Slot(0, A, busy=True), Slot(1, B)], A, 1),  # its slot is busy: another one
        ([Slot(0, busy=True), Slot(1, busy=True)], A, None),
    ],
)
def test_choose_slot(slots: list[Slot], prompt: tuple[int, ...], expected: int | None) -> None:
    assert choose_slot(slots, prompt) == expected


def test_token_chain_is_prefix_closed() -> None:
    assert A_THEN_MORE[: len(A)] == A
    assert token_chain(list(range(TOKEN_BLOCK - 1))) == ()


async def test_hold_tracks_reports_and_waits() -> None:
    reports: list[tuple[int, ...]] = []
    table = SlotTable(1, reports.append)
    async with table.hold(A, (11, 12)) as (slot, reused):
        assert (slot, reused) == (0, 0)
        assert reports == [(11, 12)]
        waiting = asyncio.create_task(_hold_once(table, A_THEN_MORE, (11, 12, 13)))
        await asyncio.sleep(0)
        assert not waiting.done()  # the only slot is busy: it waits here
    assert await waiting == (0, len(A) * TOKEN_BLOCK)  # then reuses what the first left
    assert reports[-1] == (11, 12, 13)
    table.reset("llama-server restarted")
    assert reports[-1] == () and table.summary() == ()
    async with table.hold(A, (11,)) as (_, reused):
        assert reused == 0  # a restarted llama-server holds nothing


async def _hold_once(
    table: SlotTable, prompt: tuple[int, ...], content: tuple[int, ...]
) -> tuple[int, int]:
    async with table.hold(prompt, content) as got:
        return got


@pytest.mark.parametrize(
    ("slots", "expected"),
    [
        ([Slot(0, A), Slot(1, B)], (0, 0.0)),  # its slot is idle: take it now
        ([Slot(0, A, busy=True), Slot(1, B)], (1, len(A) * TOKEN_BLOCK * 0.01)),  # worth waiting
        ([Slot(0, A[:2], busy=True), Slot(1, B)], (1, 0.0)),  # too little to wait for
        ([Slot(0, A, busy=True), Slot(1, A[:9])], (1, 0.0)),  # the idle one holds nearly as much
        ([Slot(0, A, busy=True), Slot(1, busy=True)], (None, len(A) * TOKEN_BLOCK * 0.01)),
        # still computing that prefix: recomputing it now would halve both speeds
        ([Slot(0, A, busy=True, computing=True), Slot(1, B)], (1, len(A) * TOKEN_BLOCK * 0.02)),
    ],
)
def test_plan_slot(slots: list[Slot], expected: tuple[int | None, float]) -> None:
    assert plan_slot(slots, A_THEN_MORE, 0.01) == expected


async def test_a_job_waits_for_the_busy_slot_computing_its_prefix() -> None:
    """Two requests of one tenant together: the second reuses the first's slot once free,
    rather than compute the same prefix again in another slot."""
    table = SlotTable(2, lambda _: None)
    table.s_per_token = 10.0  # recomputing would take ages: wait as long as it takes
    async with table.hold(A, ()) as (first, _):
        second = asyncio.create_task(_hold_once(table, A_THEN_MORE, ()))
        await asyncio.sleep(0)
        assert not second.done()  # the other slot is idle, but holds none of it
    assert await second == (first, len(A) * TOKEN_BLOCK)


async def test_the_wait_for_a_busy_slot_is_bounded() -> None:
    table = SlotTable(2, lambda _: None)
    table.s_per_token = 0.0001  # recomputing is quick: wait ~16 ms at most
    async with table.hold(A, ()) as (first, _):
        slot, reused = await _hold_once(table, A_THEN_MORE, ())
        assert slot != first and reused == 0


def test_observe_tracks_the_prompt_speed() -> None:
    table = SlotTable(1, lambda _: None)
    for _ in range(30):
        table.observe(0, 1000, 10.0)  # a loaded CPU: 100 prompt tokens/s
    assert table.s_per_token == pytest.approx(0.01, rel=1e-3)
    before = table.s_per_token
    table.observe(0, 3, 100.0)  # too few tokens to tell
    assert table.s_per_token == before


def test_the_speed_measured_at_start_replaces_the_guess() -> None:
    table = SlotTable(1, lambda _: None)
    table.measured(128, 3.2)  # a loaded 2-core machine: 25 ms per prompt token
    assert table.s_per_token == pytest.approx(0.025)
    table.observe(0, 1000, 20.0)  # jobs refine it from there
    assert 0.02 < table.s_per_token < 0.025


async def test_until_measured_a_job_waits_for_the_slot_holding_its_prefix() -> None:
    """The first jobs arrive while llama-server's prompt speed is being measured: a job
    waits for the busy slot holding its prefix rather than compute it again at once."""
    table = SlotTable(2, lambda _: None)
    assert math.isinf(table.s_per_token)
    async with table.hold(A, ()) as (first, _):
        second = asyncio.create_task(_hold_once(table, A_THEN_MORE, ()))
        await asyncio.sleep(0.05)
        assert not second.done()
    assert await second == (first, len(A) * TOKEN_BLOCK)
    table.not_measured()  # the measurement failed: the guess
    assert table.s_per_token == PROMPT_S_PER_TOKEN
    table.observe(0, 1000, 10.0)
    table.not_measured()  # a later failure keeps what jobs measured
    assert table.s_per_token != PROMPT_S_PER_TOKEN


async def test_a_job_waiting_until_measured_looks_again_once_measured() -> None:
    table = SlotTable(2, lambda _: None)
    async with table.hold(A, ()) as (first, _):  # a long answer, say
        second = asyncio.create_task(_hold_once(table, A_THEN_MORE, ()))
        await asyncio.sleep(0.05)
        assert not second.done()  # the speed is not known: it waits
        table.measured(1000, 0.001)  # recomputing is quick: no longer worth waiting
        slot, reused = await asyncio.wait_for(second, 1.0)
        assert slot != first and reused == 0
