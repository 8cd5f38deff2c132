"""STAND-IN workers: protocol-level fakes that load a router with a large, idle fleet.

Each stand-in opens the workers' WebSocket, registers with the real wire messages
(``protocol.messages.Register``), then sends a ``Heartbeat`` at the interval the router asks
for (``Registered.heartbeat_interval_s``), and nothing else: it runs no backend and serves a
model nobody asks for (``STANDIN_MODEL``), so the router counts it, lists it and walks past it
when it places a job, but never gives it one. A job that reaches one anyway is failed back
(``JobFailed``), so a mistake shows instead of hanging.

Many stand-ins share one process (and one event loop); a fleet of thousands is split over a
few such processes by ``benchmarks/many_workers.py``:

    python benchmarks/standins.py --router 127.0.0.1:8000 --count 5000 --first 0

It prints one JSON line when every stand-in has registered (``{"registered": N, "s": T,
"failures": F}``: F dials, registrations or connections that failed on the way, each dialed
again after a pause as a worker does) and then keeps them connected until it is terminated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time

import websockets
from websockets.asyncio.client import ClientConnection

from shoal.protocol.ids import JobId, ModelName, WorkerId
from shoal.protocol.messages import (
    PROTOCOL_VERSION,
    WS_PATH,
    BackendState,
    Endpoint,
    ErrorBody,
    Hardware,
    Heartbeat,
    HeartbeatInterval,
    JobFailed,
    JobStart,
    ModelInfo,
    Register,
    Registered,
    decode_router_message,
    encode,
)

STANDIN_MODEL = ModelName("standin-idle")
"""The model every stand-in says it serves: no benchmark request asks for it."""
RAM_BYTES = 64 * 2**30
HANDSHAKES_AT_ONCE = 64
"""Registrations in flight at a time per process (a real fleet's do not all land at once)."""


def register(index: int) -> Register:
    """The registration of stand-in ``index`` (its id and name are unique in the fleet)."""
    return Register(
        protocol_version=PROTOCOL_VERSION,
        worker_id=WorkerId(f"standin-{index:06d}"),
        name=f"standin-{index}",
        hardware=Hardware(
            hostname=f"standin-host-{index}",
            os="Linux",
            cpu_count=8,
            ram_total_bytes=RAM_BYTES,
            ram_available_bytes=RAM_BYTES // 2,
        ),
        models=(
            ModelInfo(
                name=STANDIN_MODEL,
                endpoints=(Endpoint.CHAT, Endpoint.COMPLETIONS),
                context_length=4096,
            ),
        ),
        slots=4,
        state=BackendState.READY,
        software="standin",
    )


class StandIn:
    """One stand-in worker: register, then heartbeat until the connection ends."""

    def __init__(self, index: int, url: str) -> None:
        self.index = index
        self.url = url
        self.registered = asyncio.Event()
        self.interval = 5.0
        """The interval the router asked for (``Registered``, then ``HeartbeatInterval``)."""
        self.failures = 0
        """Dials or registrations that failed, and connections the router closed (each is
        dialed again after a pause, as a worker does)."""

    async def run(self, gate: asyncio.Semaphore) -> None:
        while True:
            try:
                await self._session(gate)
            except* (OSError, TimeoutError, websockets.WebSocketException):
                pass  # dialed again below, as a worker does
            self.failures += 1
            await asyncio.sleep(random.uniform(1.0, 3.0))

    async def _session(self, gate: asyncio.Semaphore) -> None:
        """One connection: register, then heartbeat until the router closes it."""
        async with gate:
            ws = await websockets.connect(
                self.url, ping_interval=20, ping_timeout=20, compression=None, open_timeout=60
            )
            await ws.send(encode(register(self.index)))
            async with asyncio.timeout(60):
                reply = decode_router_message(await ws.recv())
        if not isinstance(reply, Registered):
            raise websockets.InvalidMessage(f"stand-in {self.index}: the router said {reply.type}")
        self.registered.set()
        self.interval = reply.heartbeat_interval_s
        async with ws, asyncio.TaskGroup() as tg:
            beating = tg.create_task(self._heartbeat(ws))
            await self._read(ws)  # until the router closes it
            beating.cancel()

    async def _heartbeat(self, ws: ClientConnection) -> None:
        await asyncio.sleep(random.uniform(0, self.interval))  # spread over the interval
        beat = encode(
            Heartbeat(state=BackendState.READY, running_jobs=0, ram_available_bytes=RAM_BYTES // 2)
        )
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                await ws.send(beat)
                await asyncio.sleep(self.interval)  # a new one applies from the next beat

    async def _read(self, ws: ClientConnection) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for frame in ws:
                msg = decode_router_message(frame)
                if isinstance(msg, JobStart):
                    await ws.send(encode(_refuse(msg.job_id)))
                elif isinstance(msg, HeartbeatInterval):
                    self.interval = msg.seconds


def _refuse(job_id: JobId) -> JobFailed:
    error = ErrorBody(message="a stand-in runs no model", type="server_error")
    return JobFailed(job_id=job_id, status=503, error=error)


async def fleet(router: str, first: int, count: int) -> None:
    url = f"ws://{router}{WS_PATH}"
    gate = asyncio.Semaphore(HANDSHAKES_AT_ONCE)
    standins = [StandIn(first + i, url) for i in range(count)]
    started = time.monotonic()
    async with asyncio.TaskGroup() as tg:
        for s in standins:
            tg.create_task(s.run(gate))
        for s in standins:
            await s.registered.wait()
        took = time.monotonic() - started
        failures = sum(s.failures for s in standins)
        print(json.dumps({"registered": count, "s": round(took, 3), "failures": failures}))
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router", required=True, help="HOST:PORT of the router")
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--first", type=int, default=0, help="index of the first stand-in")
    args = parser.parse_args()
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner, contextlib.suppress(KeyboardInterrupt):
        runner.run(fleet(args.router, args.first, args.count))
    sys.exit(0)


if __name__ == "__main__":
    main()
