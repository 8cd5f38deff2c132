"""Pinning each text job to a llama-server slot by its content, then ``SlotTable``.

The slot is chosen from the request alone: its content chain (``protocol.prefix.chain_of``,
the same blocks and hashes the router matches on, the first ``slots.SLOT_MAX_BLOCKS``, and
one for the bytes after the last whole block, so that a prompt shorter than a block goes back
to the slot that holds it), so no call to llama-server comes before the completion is sent.
(Asking llama-server for the prompt's exact tokens, ``/apply-template`` then ``/tokenize``,
cost two serial loopback round trips on every job: 4.6 ms of the 5.8 ms Shoal added to the
first token on an H100.)

Each time llama-server becomes ready, ``run_measure`` computes one short prompt
(``MEASURE_PROMPT``, about 128 tokens, not cached) on a slot it takes like a job and sets the
table's prompt speed from llama-server's own ``timings``: how long a busy slot holding a
job's prefix is worth waiting for (a fixed guess was 5 times too short on a loaded 2-core
machine). Until then a job waits for such a slot however long it takes; jobs refine it
(their prompt's tokens estimated from its content, ``prefix.BYTES_PER_TOKEN``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
import orjson

from shoal.protocol.messages import Endpoint, JobStart
from shoal.protocol.prefix import BLOCK_BYTES, BYTES_PER_TOKEN, MAX_BLOCKS, canonical, chain_of
from shoal.worker.text import loopback
from shoal.worker.text.slots import SLOT_MAX_BLOCKS, SlotTable

log = logging.getLogger(__name__)

PINNED = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES})
"""The endpoints whose requests llama-server runs in the slot ``id_slot`` names (its
Anthropic converter drops the field: a Messages request goes where llama-server puts it)."""
MEASURE_PROMPT = " ".join(
    f"Item {i} of the inventory is stored on shelf {i % 7}." for i in range(10)
)
"""About 128 tokens of text that no job shares."""
MEASURE_TIMEOUT = aiohttp.ClientTimeout(total=60.0)
"""Computing ``MEASURE_PROMPT`` takes a second on a slow, loaded CPU; past this the guess
stays."""
JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass(frozen=True, slots=True)
class Pin:
    slot: int
    expected_reuse: int
    """Prompt tokens the slot is expected to hold already (``slots.TOKENS_PER_BLOCK``)."""
    prompt_tokens: int
    """The prompt's tokens, estimated from its content (``prefix.BYTES_PER_TOKEN``)."""
    taken_at: float
    """When the job took its slot (``time.perf_counter``)."""


class SlotPinning:
    def __init__(
        self, table: SlotTable, session: aiohttp.ClientSession, base_url: Callable[[], str]
    ) -> None:
        self.table = table
        self._session = session
        self._base_url = base_url
        self._ready = asyncio.Event()

    def ready(self) -> None:
        """llama-server became ready: measure its prompt speed (``run_measure``)."""
        self._ready.set()

    async def run_measure(self) -> None:
        """Measure the prompt speed each time llama-server becomes ready."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            await self.measure()

    async def measure(self) -> None:
        """Compute ``MEASURE_PROMPT`` on a slot taken like a job's; its ``timings`` set the
        table's prompt speed."""
        body = {"prompt": MEASURE_PROMPT, "n_predict": 1, "cache_prompt": False}
        try:
            async with self.table.hold((), ()) as (slot, _):
                got = await self._post("/completion", {**body, "id_slot": slot}, MEASURE_TIMEOUT)
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            log.warning("could not measure llama-server's prompt speed: %r", exc)
            self.table.not_measured()
            return
        timings = got.get("timings")
        n = timings.get("prompt_n") if isinstance(timings, dict) else None
        ms = timings.get("prompt_ms") if isinstance(timings, dict) else None
        if isinstance(n, int) and isinstance(ms, int | float) and n > 0 and ms > 0:
            self.table.measured(n, ms / 1000)
        else:
            log.warning("could not measure llama-server's prompt speed: no timings in %.200s", got)
            self.table.not_measured()

    @contextlib.asynccontextmanager
    async def pin(self, job: JobStart) -> AsyncIterator[Pin | None]:
        """The slot ``job`` runs on (None: not a job pinned to a slot). Nothing is asked of
        llama-server: the job's content chooses."""
        if job.endpoint not in PINNED:
            yield None
            return
        data = canonical(job.body)
        blocks = chain_of(job.model, data, SLOT_MAX_BLOCKS, tail=True)
        content = blocks[: min(len(data) // BLOCK_BYTES, MAX_BLOCKS)]  # the router's chain
        async with self.table.hold(blocks, content) as (slot, reused):
            tokens = max(int(len(data) / BYTES_PER_TOKEN), reused)
            log.debug(
                "job %s: slot %d, ~%d of ~%d prompt tokens held", job.job_id, slot, reused, tokens
            )
            yield Pin(slot, reused, tokens, time.perf_counter())

    def first_output(self, pin: Pin) -> None:
        """The job's first output arrived: its prompt is computed (the prompt speed here)."""
        self.table.observe(
            pin.slot, pin.prompt_tokens - pin.expected_reuse, time.perf_counter() - pin.taken_at
        )

    async def _post(
        self, path: str, body: object, timeout: aiohttp.ClientTimeout
    ) -> dict[str, object]:
        """POST ``body`` to ``path`` (``loopback.post``); what it answered, {} unless 200."""
        url = self._base_url() + path
        async with await loopback.post(
            self._session, url, orjson.dumps(body), JSON_HEADERS, timeout
        ) as resp:
            raw = await resp.read()
            if resp.status != 200:
                log.debug("%s answered %d: %.200s", path, resp.status, raw)
                return {}
            got = orjson.loads(raw)
            return got if isinstance(got, dict) else {}
