"""The router's side of the tunnels: pairs each head connection with a stage connection.

A head worker's ``HeadEndpoint`` dials the hub once per connection ``llama-server`` opens to
it. The hub checks the hello, numbers the connection, and asks the router (the
``on_stage_wanted`` callback, which sends a control message over the stage worker's
WebSocket) to have the stage dial back with that number. When the stage's connection arrives
with the stage token, both get ``OK <n>`` and the hub relays raw bytes between them until
either closes. A head whose stage does not arrive within ``stage_timeout`` gets ``ERR``.

Plain TCP connections are relayed on two threads each (``SocketRelay``); with TLS (the
router's certificate) the relay runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from shoal.tunnel.handshake import (
    HANDSHAKE_TIMEOUT_S,
    STAGE_TIMEOUT_S,
    HandshakeError,
    Hello,
    Side,
    StageWanted,
    TunnelId,
    err_line,
    new_token,
    new_tunnel_id,
    ok_line,
    parse_hello,
    token_matches,
)
from shoal.tunnel.link import Link, LinkRelay
from shoal.tunnel.relay import TURNAROUNDS_KEPT, RelayMode, Traffic

log = logging.getLogger(__name__)


StageWantedCallback = Callable[[StageWanted], Awaitable[None]]
"""Asks the stage worker to dial back; raises StageUnavailable if it cannot be asked."""


class StageUnavailable(Exception):
    """The stage worker cannot be asked to dial back (not connected, deployment gone).

    Raised by the router's ``on_stage_wanted``; the head connection is refused with the message.
    """


@dataclass
class Tunnel:
    """One head-to-stage tunnel: its id, its two secrets, and what went through it."""

    id: TunnelId
    head_token: str = field(repr=False)
    stage_token: str = field(repr=False)
    connections: int = 0
    """Head connections accepted so far (the last connection number handed out)."""
    turnarounds: deque[int] = field(
        default_factory=lambda: deque(maxlen=TURNAROUNDS_KEPT), repr=False
    )
    """The last request->reply turnarounds of all its connections, in ns (``Traffic``)."""
    _closed_traffic: Traffic = field(default_factory=Traffic, repr=False)
    _live: set[LinkRelay] = field(default_factory=set, repr=False)

    @property
    def bytes_head_to_stage(self) -> int:
        return self._closed_traffic.a_to_b + sum(r.traffic.a_to_b for r in self._live)

    @property
    def bytes_stage_to_head(self) -> int:
        return self._closed_traffic.b_to_a + sum(r.traffic.b_to_a for r in self._live)

    @property
    def live_connections(self) -> int:
        return len(self._live)


class TunnelHub:
    """An asyncio TCP (or TLS) server that pairs and relays tunnel connections.

    ``await hub.serve()`` runs it (inside the router's TaskGroup) until cancelled; ``started``
    is set once it listens, and ``port`` is then the bound port. ``open_tunnel()`` and
    ``close_tunnel()`` may be called at any time from the event loop's thread.
    """

    def __init__(
        self,
        on_stage_wanted: StageWantedCallback,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl_context: ssl.SSLContext | None = None,
        stage_timeout: float = STAGE_TIMEOUT_S,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
        relay_mode: RelayMode = "copy",
    ) -> None:
        self.on_stage_wanted = on_stage_wanted
        self.host, self.port, self.ssl_context = host, port, ssl_context
        self.stage_timeout, self.handshake_timeout = stage_timeout, handshake_timeout
        self.relay_mode = relay_mode
        self.started = asyncio.Event()
        self._tunnels: dict[TunnelId, Tunnel] = {}
        self._waiting: dict[tuple[TunnelId, int], asyncio.Future[Link]] = {}

    # -- the router's API -------------------------------------------------------------

    def open_tunnel(self, tunnel_id: TunnelId | None = None) -> Tunnel:
        """A new tunnel with fresh random tokens for its head and its stage."""
        tunnel = Tunnel(tunnel_id or new_tunnel_id(), new_token(), new_token())
        if tunnel.id in self._tunnels:
            raise ValueError(f"tunnel {tunnel.id} is already open")
        self._tunnels[tunnel.id] = tunnel
        log.info("tunnel %s: opened", tunnel.id)
        return tunnel

    def close_tunnel(self, tunnel_id: TunnelId) -> None:
        """Forget the tunnel and end its live and waiting connections (idempotent)."""
        tunnel = self._tunnels.pop(tunnel_id, None)
        if tunnel is None:
            return
        for relay in list(tunnel._live):
            relay.close()
        for (tid, _), waiter in list(self._waiting.items()):
            if tid == tunnel_id and not waiter.done():
                waiter.cancel()
        log.info(
            "tunnel %s: closed after %d connection(s), %d bytes to stage, %d to head",
            tunnel_id,
            tunnel.connections,
            tunnel.bytes_head_to_stage,
            tunnel.bytes_stage_to_head,
        )

    def tunnel(self, tunnel_id: TunnelId) -> Tunnel | None:
        return self._tunnels.get(tunnel_id)

    # -- serving ----------------------------------------------------------------------

    async def serve(self) -> None:
        async with asyncio.TaskGroup() as tg:
            if self.ssl_context is None:
                await self._serve_plain(tg)
            else:
                await self._serve_tls(tg)

    async def _serve_plain(self, tg: asyncio.TaskGroup) -> None:
        loop = asyncio.get_running_loop()
        listener = socket.create_server((self.host, self.port), backlog=128)
        listener.setblocking(False)
        with listener:
            self.port = listener.getsockname()[1]
            self._announce()
            while True:
                sock, _ = await loop.sock_accept(listener)
                tg.create_task(self._handle(Link(sock=sock)))

    async def _serve_tls(self, tg: asyncio.TaskGroup) -> None:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            tg.create_task(self._handle(Link(stream=(reader, writer))))

        server = await asyncio.start_server(
            accepted, self.host, self.port, ssl=self.ssl_context, backlog=128
        )
        async with server:
            self.port = server.sockets[0].getsockname()[1]
            self._announce()
            await server.serve_forever()

    def _announce(self) -> None:
        log.info(
            "tunnel hub listening on %s:%d (%s)",
            self.host,
            self.port,
            "tls" if self.ssl_context else "plain tcp",
        )
        self.started.set()

    async def _handle(self, link: Link) -> None:
        handed_over = False
        try:
            handed_over = await self._hello_then_route(link)
        finally:
            if not handed_over:  # refused, relayed and done, or cancelled: closing is idempotent
                link.close()

    async def _hello_then_route(self, link: Link) -> bool:
        """Check the hello and serve the link; True if another task now owns the link."""
        try:
            async with asyncio.timeout(self.handshake_timeout):
                hello = parse_hello(await link.read_line())
            tunnel = self._check(hello)
        except TimeoutError:
            await link.refuse(err_line("no hello line in time"))
            return False
        except HandshakeError as exc:
            log.info("tunnel connection refused: %s", exc.reason)
            await link.refuse(err_line(exc.reason))
            return False
        except (OSError, ConnectionError) as exc:  # gone before its hello: nothing to answer
            log.debug("tunnel connection dropped during hello: %s", exc)
            return False
        if hello.side is Side.HEAD:
            await self._head(tunnel, link)
            return False
        return await self._stage(tunnel, hello, link)

    def _check(self, hello: Hello) -> Tunnel:
        tunnel = self._tunnels.get(hello.tunnel_id)
        expected = None
        if tunnel is not None:
            expected = tunnel.head_token if hello.side is Side.HEAD else tunnel.stage_token
        # compare even for an unknown tunnel, so timing does not tell which tunnels exist
        good = token_matches(hello.token, expected or "x" * len(hello.token))
        if tunnel is None:
            raise HandshakeError(f"unknown tunnel {hello.tunnel_id}")
        if not good:
            raise HandshakeError(f"wrong token for the {hello.side} of tunnel {tunnel.id}")
        return tunnel

    async def _head(self, tunnel: Tunnel, head: Link) -> None:
        tunnel.connections += 1
        conn_no = tunnel.connections
        key = (tunnel.id, conn_no)
        waiter: asyncio.Future[Link] = asyncio.get_running_loop().create_future()
        self._waiting[key] = waiter
        log.info("tunnel %s: head connection %d, asking the stage to dial", tunnel.id, conn_no)
        try:
            async with asyncio.timeout(self.stage_timeout):
                await self.on_stage_wanted(StageWanted(tunnel.id, conn_no, tunnel.stage_token))
                stage = await waiter
        except StageUnavailable as exc:
            log.warning("tunnel %s: connection %d: stage unavailable: %s", tunnel.id, conn_no, exc)
            await head.refuse(err_line(f"stage unavailable: {exc}"))
            return
        except TimeoutError:
            log.warning(
                "tunnel %s: the stage did not connect for connection %d within %.1f s",
                tunnel.id,
                conn_no,
                self.stage_timeout,
            )
            await head.refuse(err_line(f"the stage did not connect within {self.stage_timeout} s"))
            return
        except asyncio.CancelledError:
            if tunnel.id in self._tunnels:  # not close_tunnel(): the hub itself is stopping
                raise
            await head.refuse(err_line("tunnel closed"))
            return
        finally:
            self._waiting.pop(key, None)
        try:
            await self._pair(tunnel, conn_no, head, stage)
        finally:
            stage.close()  # already closed by the relay, unless cancelled before it started

    async def _pair(self, tunnel: Tunnel, conn_no: int, head: Link, stage: Link) -> None:
        relay = LinkRelay(
            head,
            stage,
            name=f"{tunnel.id}#{conn_no}",
            mode=self.relay_mode,
            traffic=Traffic(turnarounds=tunnel.turnarounds),
        )
        try:
            await stage.send(ok_line(conn_no))
            await head.send(ok_line(conn_no))
        except (OSError, ConnectionError) as exc:
            log.info("tunnel %s: connection %d lost while pairing: %s", tunnel.id, conn_no, exc)
            await head.aclose()
            await stage.aclose()
            return
        tunnel._live.add(relay)
        log.info("tunnel %s: connection %d paired", tunnel.id, conn_no)
        try:
            await relay.run()
        finally:
            tunnel._live.discard(relay)
            tunnel._closed_traffic.a_to_b += relay.traffic.a_to_b
            tunnel._closed_traffic.b_to_a += relay.traffic.b_to_a
        log.info(
            "tunnel %s: connection %d ended (%d bytes to stage, %d to head)",
            tunnel.id,
            conn_no,
            relay.traffic.a_to_b,
            relay.traffic.b_to_a,
        )

    async def _stage(self, tunnel: Tunnel, hello: Hello, stage: Link) -> bool:
        assert hello.conn_no is not None
        waiter = self._waiting.get((tunnel.id, hello.conn_no))
        if waiter is None or waiter.done():
            log.info("tunnel %s: stage for connection %d not awaited", tunnel.id, hello.conn_no)
            await stage.refuse(err_line(f"no head connection {hello.conn_no} is waiting"))
            return False
        waiter.set_result(stage)  # the head's task relays it from here
        return True
