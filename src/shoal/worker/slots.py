"""What each of llama-server's slots holds, and which slot a job takes.

llama-server keeps the last prompt of each slot in its KV cache and reuses the longest
common prefix when the next request on that slot shares it. The worker picks the slot
itself (the request's ``id_slot``), so it knows exactly what every slot holds:

* a slot's holding is the prompt's exact tokens (llama-server's own ``/apply-template`` and
  ``/tokenize``, ``worker/pinning.py``) kept as chained hashes of ``TOKEN_BLOCK``-token
  blocks, and the request's content chain (``protocol/prefix.py``), which is what the
  router matches;
* a job takes the idle slot holding the most of its prompt's leading blocks, ties to the
  least recently used (which is what llama-server itself would evict);
* when a busy slot holds (or is computing) much more of the prompt than any idle one, as
  when a tenant's requests arrive together, the job waits for that slot, but no longer than
  computing the difference would take (``plan_slot``, at the prompt speed measured here),
  twice that while the busy slot is still computing its prompt (both computations would
  share the CPU, each at half speed): recomputing a prefix in a second slot costs the CPU
  both jobs share;
* when every slot is busy (the router never sends more jobs than slots, but a job pinned to
  no known slot can make it so) the job waits here for the first slot to free, rather than
  queue inside llama-server behind a slot chosen blindly;
* a restarted (or unloaded) llama-server holds nothing: ``reset``.

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

import array
import asyncio
import contextlib
import hashlib
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from shoal.protocol.prefix import held_blocks

log = logging.getLogger(__name__)

TOKEN_BLOCK = 16
"""Tokens per block of a slot's holding: a prefix is matched to within 16 tokens."""


def token_chain(tokens: Sequence[int]) -> tuple[int, ...]:
    """Chained hashes of the whole ``TOKEN_BLOCK``-token blocks of ``tokens``."""
    raw = array.array("i", tokens).tobytes()
    size = TOKEN_BLOCK * 4  # array("i") items are 4 bytes
    chain: list[int] = []
    prev = b""
    for start in range(0, len(raw) - size + 1, size):
        prev = hashlib.blake2b(prev + raw[start : start + size], digest_size=8).digest()
        chain.append(int.from_bytes(prev, "big"))
    return tuple(chain)


@dataclass(slots=True)
class Slot:
    id: int
    blocks: tuple[int, ...] = ()
    """The token-block chain of the prompt it last ran."""
    content: tuple[int, ...] = ()
    """That prompt's content chain (``protocol.prefix.prefix_chain``)."""
    busy: bool = False
    computing: bool = False
    """Busy with a job whose prompt is not computed yet (no output so far)."""
    last_used: int = 0
    """When it last took a job, in jobs taken by this table (0: never)."""


def choose_slot(slots: Sequence[Slot], blocks: tuple[int, ...]) -> int | None:
    """The idle slot holding the most leading blocks of ``blocks``; ties to the least
    recently used, then the lowest id. None when every slot is busy."""
    best: tuple[int, int, int] | None = None
    for slot in slots:
        if slot.busy:
            continue
        key = (-held_blocks(blocks, slot.blocks), slot.last_used, slot.id)
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
    idle_match = held_blocks(blocks, slots[idle].blocks) if idle is not None else 0
    busy_match, computing = max(
        ((held_blocks(blocks, s.blocks), s.computing) for s in slots if s.busy), default=(0, False)
    )
    gain = (busy_match - idle_match) * TOKEN_BLOCK
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
        if computed >= TOKEN_BLOCK and seconds > 0:
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
        """Take a slot for one job whose prompt is ``blocks``; yields the slot's id and the
        tokens it is expected to reuse. The slot is free again when the block exits."""
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
        reused = held_blocks(blocks, slot.blocks) * TOKEN_BLOCK
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

    def reset(self, why: str) -> None:
        """llama-server (re)started: every slot is empty."""
        if any(slot.blocks or slot.content for slot in self.slots):
            log.info("slot holdings cleared: %s", why)
            for slot in self.slots:
                slot.blocks, slot.content = (), ()
            self._on_change(())
