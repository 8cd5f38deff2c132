"""An OpenAI-compatible server we did not start (llama-server, vLLM, Ollama): watched, not run.

LOADING ──/v1/models answers──▶ READY ──3 failed checks──▶ LOADING ...

``ALLOWED`` is that diagram as a table (``shoal.lifecycle``); any other move raises
``IllegalTransition``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp

from shoal.lifecycle import Lifecycle, Transitions
from shoal.protocol.messages import BackendState
from shoal.worker.lifecycle import StateCallback

log = logging.getLogger(__name__)

CHECK_PERIOD_S = 10.0
CHECK_PERIOD_WHILE_DOWN_S = 2.0
CHECK_TIMEOUT_S = 5.0
FAILURES_BEFORE_DOWN = 3

ALLOWED = Transitions(
    {
        BackendState.LOADING: frozenset({BackendState.READY}),
        BackendState.READY: frozenset({BackendState.LOADING}),
        BackendState.RESTARTING: frozenset(),  # not ours to restart, unload or give up on
        BackendState.UNLOADED: frozenset(),
        BackendState.FAILED: frozenset(),
    }
)


@dataclass
class AttachedServer:
    url: str
    on_state: StateCallback
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    _life: Lifecycle[BackendState] = field(init=False)

    def __post_init__(self) -> None:
        self._life = Lifecycle(f"attached backend {self.url}", ALLOWED, BackendState.LOADING, log)

    @property
    def state(self) -> BackendState:
        return self._life.state

    def _move(self, state: BackendState, detail: str) -> None:
        self._life.move(state, detail)
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
