"""Pinning each text job to a llama-server slot: its exact prompt tokens, then ``SlotTable``.

The tokens come from llama-server itself, so a chat template is rendered and tokenized
exactly as the completion will be: ``POST /apply-template`` with the job's body (the same
parser the chat endpoint runs, tools and template arguments included), then
``POST /tokenize`` with the special-token flags the completion endpoints use
(``add_special`` and ``parse_special`` true, tools/server/server-context.cpp). Two loopback
calls per job, handled on llama-server's HTTP threads (not its slot loop), so they do not wait
behind running generations. When they fail (a body llama-server will reject anyway) the job
still takes a slot, holding nothing known.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
import orjson

from shoal.protocol.messages import Endpoint, JobStart
from shoal.protocol.prefix import prefix_chain
from shoal.worker.slots import SlotTable, token_chain

log = logging.getLogger(__name__)

PINNED = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})
TOKENIZE_TIMEOUT = aiohttp.ClientTimeout(total=10.0)
"""Tokenizing a prompt takes milliseconds; past this llama-server is in trouble and the job
runs with a slot holding nothing known."""


@dataclass(frozen=True, slots=True)
class Pin:
    slot: int
    expected_reuse: int
    """Prompt tokens the slot already held (a multiple of ``slots.TOKEN_BLOCK``)."""
    prompt_tokens: int
    tokenize_ms: float
    taken_at: float
    """When the job took its slot (``time.perf_counter``)."""


class SlotPinning:
    def __init__(
        self, table: SlotTable, session: aiohttp.ClientSession, base_url: Callable[[], str]
    ) -> None:
        self.table = table
        self._session = session
        self._base_url = base_url

    @contextlib.asynccontextmanager
    async def pin(self, job: JobStart) -> AsyncIterator[Pin | None]:
        """The slot ``job`` runs on (None: not a job pinned to a slot)."""
        if job.endpoint not in PINNED:
            yield None
            return
        started = time.perf_counter()
        tokens = await self._tokens(job)
        tokenize_ms = (time.perf_counter() - started) * 1000
        content = prefix_chain(job.model, job.body)
        async with self.table.hold(token_chain(tokens), content) as (slot, reused):
            log.debug(
                "job %s: slot %d, %d of %d prompt tokens held (tokenized in %.1f ms)",
                job.job_id,
                slot,
                reused,
                len(tokens),
                tokenize_ms,
            )
            yield Pin(slot, reused, len(tokens), tokenize_ms, time.perf_counter())

    def first_output(self, pin: Pin) -> None:
        """The job's first output arrived: its prompt is computed (the prompt speed here)."""
        self.table.observe(
            pin.prompt_tokens - pin.expected_reuse, time.perf_counter() - pin.taken_at
        )

    async def _tokens(self, job: JobStart) -> list[int]:
        try:
            if job.endpoint is Endpoint.CHAT:
                prompt = (await self._post("/apply-template", job.body)).get("prompt")
            else:
                prompt = job.body.get("prompt")
            if not isinstance(prompt, str | list):
                return []
            got = await self._post(
                "/tokenize", {"content": prompt, "add_special": True, "parse_special": True}
            )
            tokens = got.get("tokens")
            return [t for t in tokens if isinstance(t, int)] if isinstance(tokens, list) else []
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            log.warning("job %s: could not tokenize its prompt: %r", job.job_id, exc)
            return []

    async def _post(self, path: str, body: object) -> dict[str, object]:
        async with self._session.post(
            self._base_url() + path,
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json"},
            timeout=TOKENIZE_TIMEOUT,
        ) as resp:
            raw = await resp.read()
            if resp.status != 200:
                log.debug("%s answered %d: %.200s", path, resp.status, raw)
                return {}
            got = orjson.loads(raw)
            return got if isinstance(got, dict) else {}
