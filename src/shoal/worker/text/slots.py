"""What each of llama-server's slots holds, and which slot a job takes.

llama-server keeps the last prompt of each slot in its KV cache and reuses the longest
common prefix when the next request on that slot shares it. The worker picks the slot
itself (the request's ``id_slot``), so it knows what every slot holds:

* a slot's holding is its last request's content chain (``protocol/prefix.py``: the
  messages or prompt in 256-byte blocks, chained hashes, the first ``SLOT_MAX_BLOCKS``, and
  one for the bytes after the last whole block),
  computed here from the request alone, so that no call to llama-server comes before the
  completion. A chat template renders messages in order, so two requests whose content
  shares its first blocks share the prompt's leading tokens up to about there (a block is
  worth ``TOKENS_PER_BLOCK`` tokens, roughly); the router matches the first
  ``prefix.MAX_BLOCKS`` of the same chain;
* a job takes the idle slot holding the most of its leading blocks, ties to the least
  recently used (which is what llama-server itself would evict). A match counts only when
  it is at least a ``MEANINGFUL_SHARE``-th of the job's content (as llama-server's own
  ``--slot-prompt-similarity``, 0.1): a short prompt sharing a line with a slot that holds
  a long cached prefix does not take that slot and throw the prefix away;
* when a busy slot holds (or is computing) much more of the prompt than any idle one, as
  when a tenant's requests arrive together, the job waits for that slot, but no longer than
  computing the difference would take (``plan_slot``, at the prompt speed measured here),
  twice that while the busy slot is still computing its prompt (both computations would
  share the CPU, each at half speed): recomputing a prefix in a second slot costs the CPU
  both jobs share;
* when every slot is busy (the router never sends more jobs than slots, but a job pinned to
  no known slot can make it so) the job waits here for the first slot to free, rather than
  queue inside llama-server behind a slot chosen blindly;
* a restarted (or unloaded) llama-server holds nothing: ``reset``; one whose slots' caches
  were saved before it was unloaded holds them again once they are put back (``reserved``
  while that runs, then ``restored``: ``residency/kv_saves.py``).

Every change calls ``on_change`` with the summary the router matches on: the set of
content hashes the slots hold (at most ``slots × prefix.MAX_BLOCKS``).

llama-server's host-memory prompt cache (``--cache-ram``, 8 GiB by default in the pinned
build) is not counted. With ``--cache-idle-slots`` (on by default) every idle slot's prompt
is copied into it as each task starts, but it is read back only in ``get_available_slot``
(tools/server/server-context.cpp) when that function picked the slot by LRU itself (no
``id_slot``) or the slot shares more than ``--slot-prompt-similarity`` (0.1) of the request
yet keeps under half of its own tokens. A job pinned with ``id_slot`` to a slot holding
another prompt shares less than 0.1 of it, so it never loads from that cache: what the
slots hold is all this worker can reuse. (Using it would mean sending such jobs unpinned and
learning the slot afterwards.) Shoal passes ``--parallel``, so the KV cache is not unified
(``kv_unified = false`` in llama-server's log) and idle slots are saved but not cleared:
what the table says a slot holds stays true.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from shoal.protocol.prefix import expected_tokens

log = logging.getLogger(__name__)

SLOT_MAX_BLOCKS = 2048
"""Blocks of a request's content a slot's holding is matched on: its first 512 KiB (about
128k tokens). The router matches the first ``prefix.MAX_BLOCKS`` of the same chain."""
TOKENS_PER_BLOCK = expected_tokens(1)
"""What one block of content is worth in prompt tokens, roughly."""
MEANINGFUL_SHARE = 10
"""A slot's match counts only when it covers at least 1/10 of the job's blocks."""


def shared_blocks(chain: tuple[int, ...], held: tuple[int, ...]) -> int:
    """The leading blocks of ``chain`` a slot holding ``held`` has (each hash covers every
    block before it: the first that differs ends the match); 0 when that is under a
    ``MEANINGFUL_SHARE``-th of ``chain``."""
    n = 0
    for mine, its in zip(chain, held, strict=False):
        if mine != its:
            break
        n += 1
    return n if n * MEANINGFUL_SHARE >= len(chain) else 0


@dataclass(slots=True)
class Slot:
    id: int
    blocks: tuple[int, ...] = ()
    """The content chain of the prompt it last ran (``protocol.prefix.chain_of``)."""
    content: tuple[int, ...] = ()
    """Its whole blocks, the first ``prefix.MAX_BLOCKS``: what the router matches."""
    busy: bool = False
    computing: bool = False
    """Busy with a job whose prompt is not computed yet (no output so far)."""
    last_used: int = 0
    """When it last took a job, in jobs taken by this table (0: never)."""


def choose_slot(slots: Sequence[Slot], blocks: tuple[int, ...]) -> int | None:
    """The idle slot holding the most leading blocks of ``blocks`` (``shared_blocks``); ties
    to the least recently used, then the lowest id. None when every slot is busy."""
    best: tuple[int, int, int] | None = None
    for slot in slots:
        if slot.busy:
            continue
        key = (-shared_blocks(blocks, slot.blocks), slot.last_used, slot.id)
        if best is None or key < best:
            best = key
    return best[2] if best is not None else None


MIN_WAIT_GAIN_TOKENS = 128
"""A busy slot is worth waiting for only when it holds at least this many more tokens of the
prompt than the best idle slot."""
PROMPT_S_PER_TOKEN = 0.005
"""How long computing one prompt token takes when it cannot be measured (a CPU at ~200
tokens/s). Until the measurement as llama-server starts (``pinning.SlotPinning.measure``)
ends, the speed is unknown (``math.inf``): a job waits for a busy slot holding its prefix
however long that takes, as the first jobs often arrive while the measurement runs."""
_RATE_WEIGHT = 0.3
"""Weight of the newest measurement in the running prompt speed."""


def plan_slot(
    slots: Sequence[Slot], blocks: tuple[int, ...], s_per_token: float
) -> tuple[int | None, float]:
    """The idle slot to take (``choose_slot``), and how long waiting for a busy slot that
    holds more of the prompt is worth: the time computing the extra tokens would take (twice
    that while that slot still computes its own prompt: computing the same tokens at once in
    two slots halves the speed of both), or 0 when no busy slot holds
    ``MIN_WAIT_GAIN_TOKENS`` more."""
    idle = choose_slot(slots, blocks)
    idle_match = shared_blocks(blocks, slots[idle].blocks) if idle is not None else 0
    busy_match, computing = max(
        ((shared_blocks(blocks, s.blocks), s.computing) for s in slots if s.busy),
        default=(0, False),
    )
    gain = (busy_match - idle_match) * TOKENS_PER_BLOCK
    if gain < MIN_WAIT_GAIN_TOKENS:
        return idle, 0.0
    return idle, gain * s_per_token * (2 if computing else 1)


class SlotTable:
    def __init__(self, slots: int, on_change: Callable[[tuple[int, ...]], None]) -> None:
        self.slots = [Slot(i) for i in range(slots)]
        self._on_change = on_change
        self._taken = 0
        self._waiters: list[asyncio.Future[None]] = []
        self.s_per_token = math.inf
        """Seconds one prompt token takes to compute here, as measured (``observe``)."""

    def observe(self, slot: int, computed: int, seconds: float) -> None:
        """A job's first output came ``seconds`` after it took ``slot``, ``computed`` prompt
        tokens later: its prompt is computed; the prompt speed, under the load there is."""
        self.slots[slot].computing = False
        if computed >= TOKENS_PER_BLOCK and seconds > 0:
            rate = seconds / computed
            if math.isinf(self.s_per_token):
                self.s_per_token = rate
            else:
                self.s_per_token += _RATE_WEIGHT * (rate - self.s_per_token)

    def measured(self, computed: int, seconds: float) -> None:
        """llama-server computed ``computed`` prompt tokens in ``seconds`` as it started: the
        prompt speed from now on (until jobs refine it, ``observe``)."""
        self.s_per_token = seconds / computed
        self._wake()  # jobs waiting for a busy slot until the speed was known look again
        log.info(
            "prompt speed: %.1f ms per token (%d tokens measured)",
            seconds * 1000 / computed,
            computed,
        )

    def not_measured(self) -> None:
        """The measurement failed: the guess, unless jobs measured it meanwhile."""
        if math.isinf(self.s_per_token):
            self.s_per_token = PROMPT_S_PER_TOKEN
            self._wake()

    def summary(self) -> tuple[int, ...]:
        """The content hashes the slots hold, sorted: what the router matches on."""
        return tuple(sorted({h for slot in self.slots for h in slot.content}))

    @contextlib.asynccontextmanager
    async def hold(
        self, blocks: tuple[int, ...], content: tuple[int, ...]
    ) -> AsyncIterator[tuple[int, int]]:
        """Take a slot for one job whose content chain is ``blocks`` (``content``: the part
        the router matches); yields the slot's id and the prompt tokens it is expected to
        reuse (roughly: ``TOKENS_PER_BLOCK``). The slot is free again when the block exits."""
        loop = asyncio.get_running_loop()
        since: float | None = None  # when it started to wait for a busy slot holding more
        while True:
            chosen, worth = plan_slot(self.slots, blocks, self.s_per_token)
            if chosen is None:
                await self._released(None)  # every slot busy
                continue
            if worth <= 0:
                break  # no busy slot holds more than this one
            if since is None:
                since = loop.time()
            left = since + worth - loop.time()  # at the speed known now (woken when measured)
            if left <= 0:
                break
            await self._released(None if math.isinf(left) else left)
        slot = self.slots[chosen]
        reused = shared_blocks(blocks, slot.blocks) * TOKENS_PER_BLOCK
        self._taken += 1
        slot.busy, slot.computing, slot.last_used = True, True, self._taken
        changed = slot.content != content
        slot.blocks, slot.content = blocks, content
        if changed:
            self._on_change(self.summary())
        try:
            yield chosen, reused
        finally:
            slot.busy = slot.computing = False
            self._wake()

    async def _released(self, timeout: float | None) -> None:
        """Until a slot is released, or ``timeout`` seconds (None: no limit)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await waiter
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _wake(self) -> None:
        """Every waiter looks again (one that was cancelled meanwhile must not keep the
        slot from the others)."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    @contextlib.contextmanager
    def reserved(self, ids: Iterable[int]) -> Iterator[tuple[int, ...]]:
        """Keep the idle slots among ``ids`` from jobs while the block runs (their KV caches
        are being saved or put back: llama-server would run that after a job there, on what
        the job left); yields the ids it reserved, leaving out a slot a job holds."""
        got = tuple(i for i in ids if not self.slots[i].busy)
        for i in got:
            self.slots[i].busy = True
        try:
            yield got
        finally:
            for i in got:
                self.slots[i].busy = False
            self._wake()

    def restored(self, slot: int, blocks: tuple[int, ...], content: tuple[int, ...]) -> None:
        """llama-server put a saved KV cache back into ``slot`` (reserved by the caller): it
        holds ``blocks`` (``content``: what the router matches) and counts as just used, so a
        job that shares nothing with it takes an emptier slot first."""
        entry = self.slots[slot]
        self._taken += 1
        entry.last_used = self._taken
        changed = entry.content != content
        entry.blocks, entry.content = blocks, content
        if changed:
            self._on_change(self.summary())

    def reset(self, why: str) -> None:
        """llama-server (re)started: every slot is empty."""
        if any(slot.blocks or slot.content for slot in self.slots):
            log.info("slot holdings cleared: %s", why)
            for slot in self.slots:
                slot.blocks, slot.content = (), ()
            self._on_change(())
