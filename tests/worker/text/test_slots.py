"""The worker's slot table: which slot a job takes, what each holds, waiting when full."""

from __future__ import annotations

import asyncio
import math

import pytest

from shoal.protocol.prefix import BLOCK_BYTES, chain_of
from shoal.worker.text.slots import (
    PROMPT_S_PER_TOKEN,
    SLOT_MAX_BLOCKS,
    TOKENS_PER_BLOCK,
    Slot,
    SlotTable,
    choose_slot,
    plan_slot,
    shared_blocks,
)


def chain(text: bytes) -> tuple[int, ...]:
    return chain_of("m", text, SLOT_MAX_BLOCKS)


A_TEXT = b"".join(bytes([65 + i]) * BLOCK_BYTES for i in range(10))  # 10 blocks
A = chain(A_TEXT)
B = chain(bytes(range(256)) * 10)
A_THEN_MORE = chain(A_TEXT + b"7" * 3 * BLOCK_BYTES)
A_TOKENS = len(A) * TOKENS_PER_BLOCK


@pytest.mark.parametrize(
    ("slots", "prompt", "expected"),
    [
        ([Slot(0), Slot(1)], A, 0),  # nothing held: the lowest id
        ([Slot(0, A, last_used=2), Slot(1, B, last_used=1)], A_THEN_MORE, 0),  # its prefix
        ([Slot(0, A, last_used=1), Slot(1, B, last_used=2)], B, 1),
        ([Slot(0, A, last_used=2), Slot(1, B, last_used=1)], chain(b"5" * 4 * BLOCK_BYTES), 1),
        ([Slot(0, A, busy=True), Slot(1, B)], A, 1),  # its slot is busy: another one
        ([Slot(0, busy=True), Slot(1, busy=True)], A, None),
    ],
)
def test_choose_slot(slots: list[Slot], prompt: tuple[int, ...], expected: int | None) -> None:
    assert choose_slot(slots, prompt) == expected


def test_a_content_chain_is_prefix_closed() -> None:
    assert A_THEN_MORE[: len(A)] == A
    assert chain(b"x" * (BLOCK_BYTES - 1)) == ()


def test_with_its_tail_a_prompt_shorter_than_a_block_matches_itself() -> None:
    short = chain_of("m", b"Explain why the sky is blue.", SLOT_MAX_BLOCKS, tail=True)
    other = chain_of("m", b"Write a short poem about the sea.", SLOT_MAX_BLOCKS, tail=True)
    assert len(short) == 1 and shared_blocks(short, short) == 1
    assert shared_blocks(other, short) == 0
    longer = chain_of("m", A_TEXT + b"tail", SLOT_MAX_BLOCKS, tail=True)
    assert longer[: len(A)] == A and len(longer) == len(A) + 1  # whole blocks as without
    slots = [Slot(0, other, last_used=1), Slot(1, short, last_used=2)]
    assert choose_slot(slots, short) == 1  # back to the slot holding it, not the LRU one


@pytest.mark.parametrize(
    ("prompt", "held", "expected"),
    [
        (A_THEN_MORE, A, 10),
        (A, A_THEN_MORE, 10),  # a slot holding more than the job: its whole prompt
        (A_THEN_MORE, A[:2], 2),  # 2 of 13 blocks: at least a tenth
        (chain(A_TEXT + b"7" * 11 * BLOCK_BYTES), A[:2], 0),  # 2 of 21: under a tenth
        (A, B, 0),
        ((), A, 0),  # a prompt under one block matches nothing
    ],
)
def test_a_match_counts_only_as_a_meaningful_share_of_the_prompt(
    prompt: tuple[int, ...], held: tuple[int, ...], expected: int
) -> None:
    assert shared_blocks(prompt, held) == expected


def test_a_short_prompt_leaves_a_long_cached_prefix_alone() -> None:
    """A prompt sharing only its first block with the slot holding a long prefix takes the
    least recently used slot instead, rather than throw that prefix away."""
    long_prompt = chain(A_TEXT[:BLOCK_BYTES] + b"L" * 40 * BLOCK_BYTES)
    short = chain(A_TEXT[:BLOCK_BYTES] + b"s" * 11 * BLOCK_BYTES)
    slots = [Slot(0, long_prompt, last_used=1), Slot(1, B, last_used=2)]
    assert choose_slot(slots, short) == 0  # 1 of 12 blocks: no match, the LRU slot
    slots[0].last_used = 3
    assert choose_slot(slots, short) == 1


async def test_hold_tracks_reports_and_waits() -> None:
    reports: list[tuple[int, ...]] = []
    table = SlotTable(1, reports.append)
    async with table.hold(A, (11, 12)) as (slot, reused):
        assert (slot, reused) == (0, 0)
        assert reports == [(11, 12)]
        waiting = asyncio.create_task(_hold_once(table, A_THEN_MORE, (11, 12, 13)))
        await asyncio.sleep(0)
        assert not waiting.done()  # the only slot is busy: it waits here
    assert await waiting == (0, A_TOKENS)  # then reuses what the first left
    assert reports[-1] == (11, 12, 13)
    table.reset("llama-server restarted")
    assert reports[-1] == () and table.summary() == ()
    async with table.hold(A, (11,)) as (_, reused):
        assert reused == 0  # a restarted llama-server holds nothing


async def test_reserved_slots_are_kept_from_jobs_and_restored_ones_report() -> None:
    """Saving or restoring a slot's cache: jobs keep off it meanwhile; what it holds once
    restored is reported, and it counts as just used (an unrelated job takes the empty one)."""
    reports: list[tuple[int, ...]] = []
    table = SlotTable(3, reports.append)
    async with table.hold(B, (21,)) as (busy, _):
        with table.reserved([0, 1, 2]) as ids:
            assert busy not in ids and len(ids) == 2  # a job's slot is left to it
            waiting = asyncio.create_task(_hold_once(table, A))
            await asyncio.sleep(0)
            assert not waiting.done()  # every slot busy or reserved: it waits
            table.restored(ids[0], A, (11, 12))
            assert reports[-1] == (11, 12, 21)
        assert await waiting == (ids[0], A_TOKENS)  # released: it takes its restored prefix
    fresh = SlotTable(2, reports.append)
    fresh.restored(0, B, (31,))
    assert reports[-1] == (31,)
    async with fresh.hold(chain(b"z" * 4 * BLOCK_BYTES), ()) as (other, _):
        assert other == 1  # the empty slot, not the one just restored
    assert fresh.summary() == (31,)


async def _hold_once(
    table: SlotTable, prompt: tuple[int, ...], content: tuple[int, ...] = ()
) -> tuple[int, int]:
    async with table.hold(prompt, content) as got:
        return got


@pytest.mark.parametrize(
    ("slots", "expected"),
    [
        ([Slot(0, A), Slot(1, B)], (0, 0.0)),  # its slot is idle: take it now
        ([Slot(0, A, busy=True), Slot(1, B)], (1, A_TOKENS * 0.01)),  # worth waiting
        ([Slot(0, A[:1], busy=True), Slot(1, B)], (1, 0.0)),  # too little to wait for
        ([Slot(0, A, busy=True), Slot(1, A[:9])], (1, 0.0)),  # the idle one holds nearly as much
        ([Slot(0, A, busy=True), Slot(1, busy=True)], (None, A_TOKENS * 0.01)),
        # still computing that prefix: recomputing it now would halve both speeds
        ([Slot(0, A, busy=True, computing=True), Slot(1, B)], (1, A_TOKENS * 0.02)),
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
        second = asyncio.create_task(_hold_once(table, A_THEN_MORE))
        await asyncio.sleep(0)
        assert not second.done()  # the other slot is idle, but holds none of it
    assert await second == (first, A_TOKENS)


async def test_the_wait_for_a_busy_slot_is_bounded() -> None:
    table = SlotTable(2, lambda _: None)
    table.s_per_token = 0.0001  # recomputing is quick: wait ~64 ms at most
    async with table.hold(A, ()) as (first, _):
        slot, reused = await _hold_once(table, A_THEN_MORE)
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
        second = asyncio.create_task(_hold_once(table, A_THEN_MORE))
        await asyncio.sleep(0.05)
        assert not second.done()
    assert await second == (first, A_TOKENS)
    table.not_measured()  # the measurement failed: the guess
    assert table.s_per_token == PROMPT_S_PER_TOKEN
    table.observe(0, 1000, 10.0)
    table.not_measured()  # a later failure keeps what jobs measured
    assert table.s_per_token != PROMPT_S_PER_TOKEN


async def test_a_job_waiting_until_measured_looks_again_once_measured() -> None:
    table = SlotTable(2, lambda _: None)
    async with table.hold(A, ()) as (first, _):  # a long answer, say
        second = asyncio.create_task(_hold_once(table, A_THEN_MORE))
        await asyncio.sleep(0.05)
        assert not second.done()  # the speed is not known: it waits
        table.measured(1000, 0.001)  # recomputing is quick: no longer worth waiting
        slot, reused = await asyncio.wait_for(second, 1.0)
        assert slot != first and reused == 0
