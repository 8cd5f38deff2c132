"""The worker's slot table: which slot a job takes, what each holds, waiting when full."""

from __future__ import annotations

import asyncio

import pytest

from shoal.worker.slots import TOKEN_BLOCK, Slot, SlotTable, choose_slot, token_chain

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
