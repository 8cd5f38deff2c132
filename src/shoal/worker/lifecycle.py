"""A backend's lifecycle on a worker, and the gate its jobs wait at until it is ready.

llama-server (``text/llama_server.py``) and an image model (``images/service.py``) each move through
``BackendState`` by their own table (``shoal.lifecycle``); ``BackendLifecycle`` adds what both
do around a move (keep the reason, wake the jobs waiting, tell the worker) and the wait of a
job: until READY, asking for a load when UNLOADED, raising when FAILED.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from shoal.lifecycle import Lifecycle, Transitions
from shoal.protocol.messages import BackendState

StateCallback = Callable[[BackendState, str], None]


class NotServing(Exception):
    """A job waited for its backend (llama-server, an image model), which failed for good
    instead of becoming ready."""


class BackendLifecycle:
    def __init__(
        self,
        name: str,
        allowed: Transitions[BackendState],
        state: BackendState,
        on_state: StateCallback,
        log: logging.Logger,
    ) -> None:
        """``on_state``: told every move, with its reason."""
        self._life = Lifecycle(name, allowed, state, log)
        self.on_state = on_state
        self.detail = ""
        """Why it is in its state (the reason of its last move)."""
        self.changed = asyncio.Event()
        """Set on every move; a waiter re-checks ``state`` (then waits on the new event)."""
        self.wanted = asyncio.Event()
        """Set when a job needs the backend while it is unloaded."""

    @property
    def state(self) -> BackendState:
        return self._life.state

    def move(self, state: BackendState, detail: str = "") -> None:
        self._life.move(state, detail)
        self.detail = detail
        self.changed.set()
        self.changed = asyncio.Event()
        self.on_state(state, detail)

    async def until_ready(self, failed: Callable[[str], Exception]) -> None:
        """Wait for READY, asking for a load while it is UNLOADED; raise ``failed(detail)``
        if it fails for good meanwhile."""
        while self.state is not BackendState.READY:
            if self.state is BackendState.FAILED:
                raise failed(self.detail)
            if self.state is BackendState.UNLOADED:
                self.wanted.set()
            await self.changed.wait()

    async def load_when_wanted(self, why: str) -> None:
        """Wait until a job wants the backend (``wanted``), then move to LOADING."""
        await self.wanted.wait()
        self.wanted.clear()
        self.move(BackendState.LOADING, why)
