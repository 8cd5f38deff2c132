"""The worker's one connection to its router, with its state machine and reconnects.

CONNECTING ──handshake ok──▶ REGISTERED ──socket lost──▶ WAITING ──backoff──▶ CONNECTING
     │                                                      ▲
     └──connect failed──────────────────────────────────────┘
refused for a bad key or protocol version ──▶ raises ``Refusal`` (retrying cannot help)
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable

import websockets
from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection

from shoal.protocol.messages import (
    BackendState,
    Heartbeat,
    JobCancel,
    JobStart,
    RefusalCode,
    Refused,
    Register,
    Registered,
    StateChanged,
    decode_router_message,
    encode,
)
from shoal.worker.backoff import Backoff
from shoal.worker.hardware import ram_available
from shoal.worker.outbox import Outbox
from shoal.worker.runner import JobRunner

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
STABLE_AFTER_S = 30.0
"""A connection that lasted this long resets the backoff."""
FATAL_REFUSALS = {RefusalCode.BAD_KEY, RefusalCode.PROTOCOL_VERSION}


class LinkState(enum.StrEnum):
    CONNECTING = "connecting"
    REGISTERED = "registered"
    WAITING = "waiting"


class Refusal(Exception):
    def __init__(self, refused: Refused) -> None:
        super().__init__(f"the router refused this worker ({refused.code}): {refused.reason}")
        self.refused = refused


class RouterLink:
    def __init__(
        self,
        url: str,
        gpu_key: str | None,
        register: Callable[[], Register],
        runner: JobRunner,
        outbox: Outbox,
        backoff: Backoff | None = None,
    ) -> None:
        self.url = url
        self.gpu_key = gpu_key
        self.register = register
        self.runner = runner
        self.outbox = outbox
        self.backoff = backoff or Backoff()
        self.state = LinkState.WAITING
        self.backend_state = BackendState.LOADING

    def _move(self, state: LinkState, why: str) -> None:
        log.info("router link %s: %s -> %s %s", self.url, self.state, state, why)
        self.state = state

    def on_backend_state(self, state: BackendState, detail: str) -> None:
        self.backend_state = state
        if self.state is LinkState.REGISTERED:
            self.outbox.send(StateChanged(state=state, detail=detail))

    async def run(self) -> None:
        attempt = 0
        while True:
            self._move(LinkState.CONNECTING, f"(attempt {attempt + 1})")
            connected = time.monotonic()
            try:
                await self._session()
                why = "router closed the connection"
            except Refusal as refusal:
                if refusal.refused.code in FATAL_REFUSALS:
                    raise
                why = str(refusal)
            except (OSError, TimeoutError, websockets.WebSocketException) as exc:
                why = f"{type(exc).__name__}: {exc}"
            finally:
                self.runner.cancel_all("router connection lost")
                self.outbox.clear()
            if time.monotonic() - connected > STABLE_AFTER_S:
                attempt = 0
            delay = self.backoff.delay(attempt)
            attempt += 1
            self._move(LinkState.WAITING, f"{why}; reconnecting in {delay:.1f} s")
            await asyncio.sleep(delay)

    async def _session(self) -> None:
        headers = {"Authorization": f"Bearer {self.gpu_key}"} if self.gpu_key else {}
        async with websockets.connect(
            self.url,
            additional_headers=headers,
            open_timeout=HANDSHAKE_TIMEOUT_S,
            ping_interval=20,
            ping_timeout=20,
            max_size=64 * 1024 * 1024,
            compression=None,
        ) as ws:
            registered = await self._handshake(ws)
            self._move(LinkState.REGISTERED, f"as {registered.worker_id}")
            self.outbox.clear()
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self.outbox.pump(ws.send))
                    tg.create_task(self._heartbeat(registered.heartbeat_interval_s))
                    await self._read(ws)
                    raise websockets.ConnectionClosedOK(None, None)  # stop the other two
            except* (OSError, websockets.WebSocketException) as group:
                raise group.exceptions[0] from None

    async def _handshake(self, ws: ClientConnection) -> Registered:
        await ws.send(encode(self.register()))
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            reply = decode_router_message(await ws.recv())
        if isinstance(reply, Refused):
            raise Refusal(reply)
        if not isinstance(reply, Registered):
            raise websockets.InvalidMessage(f"expected 'registered', got {reply.type!r}")
        return reply

    async def _heartbeat(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.outbox.send(
                Heartbeat(
                    state=self.backend_state,
                    running_jobs=self.runner.running,
                    ram_available_bytes=ram_available(),
                )
            )

    async def _read(self, ws: ClientConnection) -> None:
        async for frame in ws:
            try:
                msg = decode_router_message(frame)
            except ValidationError as exc:
                log.warning("router sent a malformed frame; reconnecting: %s", exc)
                return
            match msg:
                case JobStart():
                    self.runner.start(msg)
                case JobCancel(job_id=job_id):
                    self.runner.cancel(job_id)
                case _:
                    log.warning("unexpected %s frame from the router", msg.type)
