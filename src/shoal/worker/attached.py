"""An OpenAI-compatible server we did not start (llama-server, vLLM, Ollama): watched, not run.

LOADING ──/v1/models answers──▶ READY ──3 failed checks──▶ LOADING ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp

from shoal.protocol.messages import BackendState
from shoal.worker.llama_server import StateCallback

log = logging.getLogger(__name__)

CHECK_PERIOD_S = 10.0
CHECK_PERIOD_WHILE_DOWN_S = 2.0
CHECK_TIMEOUT_S = 5.0
FAILURES_BEFORE_DOWN = 3


@dataclass
class AttachedServer:
    url: str
    on_state: StateCallback
    state: BackendState = BackendState.LOADING
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def _move(self, state: BackendState, detail: str) -> None:
        if state is not self.state:
            log.info("attached backend %s: %s -> %s %s", self.url, self.state, state, detail)
        self.state = state
        if state is BackendState.READY:
            self.ready.set()
        self.on_state(state, detail)

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[None]:
        """Nothing to load: an attached server is someone else's to start and stop."""
        yield

    async def run(self) -> None:
        failures = 0
        timeout = aiohttp.ClientTimeout(total=CHECK_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                detail = await self._check(session)
                if detail is None:
                    failures = 0
                    if self.state is not BackendState.READY:
                        self._move(BackendState.READY, f"attached to {self.url}")
                else:
                    failures += 1
                    if self.state is BackendState.READY and failures >= FAILURES_BEFORE_DOWN:
                        self._move(BackendState.LOADING, detail)
                up = self.state is BackendState.READY
                await asyncio.sleep(CHECK_PERIOD_S if up else CHECK_PERIOD_WHILE_DOWN_S)

    async def _check(self, session: aiohttp.ClientSession) -> str | None:
        """None when the server answers /v1/models, else why not."""
        try:
            async with session.get(self.url + "/v1/models") as resp:
                return None if resp.status < 500 else f"/v1/models answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"unreachable: {exc!r}"
