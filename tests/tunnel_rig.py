"""A tunnel hub, head endpoints and a stage connector in this test's event loop.

The hub's ``on_stage_wanted`` hands the request straight to the ``StageConnector`` (in Shoal the
router sends it over the stage worker's WebSocket). Everything started is cancelled on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

from shoal.tunnel.endpoints import HeadEndpoint, HubAddress, StageConnector, TunnelError
from shoal.tunnel.handshake import StageWanted, TunnelId
from shoal.tunnel.hub import StageUnavailable, Tunnel, TunnelHub

log = logging.getLogger(__name__)


async def echo_server() -> asyncio.Server:
    """A TCP echo service on 127.0.0.1 standing in for ggml-rpc-server in relay tests."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


@dataclass
class Rig:
    hub: TunnelHub
    address: HubAddress
    tg: asyncio.TaskGroup
    connectors: dict[TunnelId, StageConnector] = field(default_factory=dict)
    """The stage worker's connector for each tunnel (its ggml-rpc-server port)."""
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    wanted: list[StageWanted] = field(default_factory=list)
    deliver: bool = True
    """False: the stage never dials back (a stage worker that is gone)."""
    unavailable: str | None = None
    """Set: on_stage_wanted raises StageUnavailable with this message."""
    stage_errors: list[TunnelError] = field(default_factory=list)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self.tg.create_task(coro)
        self.tasks.append(task)
        return task

    def open(self, rpc_port: int) -> Tunnel:
        """A tunnel whose stage is the service on 127.0.0.1:``rpc_port``."""
        tunnel = self.hub.open_tunnel()
        self.connectors[tunnel.id] = StageConnector(self.address, rpc_port)
        return tunnel

    async def head(self, tunnel: Tunnel) -> HeadEndpoint:
        endpoint = HeadEndpoint(self.address, tunnel.id, tunnel.head_token)
        self.spawn(endpoint.serve())
        await endpoint.started.wait()
        return endpoint

    async def on_stage_wanted(self, wanted: StageWanted) -> None:
        self.wanted.append(wanted)
        if self.unavailable is not None:
            raise StageUnavailable(self.unavailable)
        if self.deliver:
            self.spawn(self._stage(wanted))

    async def _stage(self, wanted: StageWanted) -> None:
        try:
            await self.connectors[wanted.tunnel_id].connect(wanted)
        except TunnelError as exc:
            self.stage_errors.append(exc)


@contextlib.asynccontextmanager
async def tunnel_rig(
    *,
    server_tls: ssl.SSLContext | None = None,
    client_tls: ssl.SSLContext | None = None,
    stage_timeout: float = 5.0,
    handshake_timeout: float = 5.0,
) -> AsyncIterator[Rig]:
    async with asyncio.TaskGroup() as tg:
        rig: Rig | None = None

        async def on_stage_wanted(wanted: StageWanted) -> None:
            assert rig is not None
            await rig.on_stage_wanted(wanted)

        hub = TunnelHub(
            on_stage_wanted,
            ssl_context=server_tls,
            stage_timeout=stage_timeout,
            handshake_timeout=handshake_timeout,
        )
        hub_task = tg.create_task(hub.serve())
        await hub.started.wait()
        address = HubAddress("127.0.0.1", hub.port, client_tls)
        rig = Rig(hub, address, tg)
        try:
            yield rig
        finally:
            for task in [*rig.tasks, hub_task]:
                task.cancel()
