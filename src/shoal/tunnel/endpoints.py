"""The worker sides of a tunnel: the head's local listener and the stage's dial-back.

``HeadEndpoint`` listens on 127.0.0.1 (an ephemeral port): the head's
``llama-server --rpc`` points at ``endpoint.rpc_address``. Each connection llama-server opens
becomes one tunnel connection: the endpoint dials the hub with the head token, waits for
``OK`` (the hub has the stage's matching connection by then) and relays.

``StageConnector`` answers the hub's request for one connection (``StageWanted``, delivered
by the router): it connects to the local ``ggml-rpc-server`` (which stays bound to 127.0.0.1)
and dials the hub with the stage token, then relays until either side closes.

Both only dial out to the hub, so workers behind NAT can take part.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections import deque
from dataclasses import dataclass

from shoal.tunnel.handshake import (
    HANDSHAKE_TIMEOUT_S,
    STAGE_TIMEOUT_S,
    HandshakeError,
    Hello,
    Side,
    StageWanted,
    TunnelId,
    TunnelRefused,
    parse_reply,
)
from shoal.tunnel.link import Link, LinkRelay
from shoal.tunnel.relay import TURNAROUNDS_KEPT, RelayMode, Traffic

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
"""How long dialling the hub or the local ggml-rpc-server may take."""
REPLY_TIMEOUT_S = STAGE_TIMEOUT_S + HANDSHAKE_TIMEOUT_S
"""How long a head waits for the hub's answer (the hub waits for the stage first)."""


class TunnelError(Exception):
    """A tunnel connection could not be set up; the message says which step failed."""


@dataclass(frozen=True)
class HubAddress:
    """Where the router's tunnel hub listens, and the TLS context if it speaks TLS."""

    host: str
    port: int
    ssl_context: ssl.SSLContext | None = None
    server_hostname: str | None = None


async def connect_plain(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket (the event loop's connect, no thread)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    last: OSError | None = None
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
        except OSError as exc:
            sock.close()
            last = exc
            continue
        return sock
    raise last or OSError(f"no address for {host}:{port}")


async def dial_hub(hub: HubAddress, hello: Hello, reply_timeout: float) -> Link:
    """A link to the hub that has sent ``hello`` and been answered ``OK``.

    TunnelError if the hub cannot be reached, refuses, or does not answer in time.
    """
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            if hub.ssl_context is None:
                link = Link(sock=await connect_plain(hub.host, hub.port))
            else:
                stream = await asyncio.open_connection(
                    hub.host,
                    hub.port,
                    ssl=hub.ssl_context,
                    server_hostname=hub.server_hostname or hub.host,
                )
                link = Link(stream=stream)
    except (OSError, TimeoutError) as exc:
        raise TunnelError(f"cannot reach the tunnel hub at {hub.host}:{hub.port}: {exc}") from exc
    answered = False
    try:
        await link.send(hello.encode())
        async with asyncio.timeout(reply_timeout):
            parse_reply(await link.read_line())
        answered = True
    except TunnelRefused as exc:
        raise TunnelError(f"the tunnel hub refused tunnel {hello.tunnel_id}: {exc}") from exc
    except (OSError, ConnectionError, TimeoutError, HandshakeError) as exc:
        raise TunnelError(
            f"no answer from the tunnel hub for tunnel {hello.tunnel_id}: {exc!r}"
        ) from exc
    finally:
        if not answered:  # refused, failed or cancelled
            link.close()
    return link


class HeadEndpoint:
    """The head worker's end of one tunnel: a 127.0.0.1 listener for ``llama-server --rpc``.

    ``await serve()`` runs it until cancelled (cancelling ends the live connections too);
    ``started`` is set once it listens, and ``rpc_address`` is then what ``--rpc`` takes.
    """

    def __init__(
        self,
        hub: HubAddress,
        tunnel_id: TunnelId,
        head_token: str,
        *,
        relay_mode: RelayMode = "copy",
        reply_timeout: float = REPLY_TIMEOUT_S,
    ) -> None:
        self.hub, self.tunnel_id, self._token = hub, tunnel_id, head_token
        self.relay_mode, self.reply_timeout = relay_mode, reply_timeout
        self.port = 0
        self.started = asyncio.Event()
        self.traffic = Traffic()
        """Bytes from llama-server to the stage (a_to_b) and back, over ended connections."""
        self.turnarounds: deque[int] = deque(maxlen=TURNAROUNDS_KEPT)
        """The last request->reply turnarounds of all its connections, in ns, as the head
        sees them: a request of llama-server leaving for the hub to the first bytes of the
        stage's reply coming back (``Traffic``). Relay threads append to it: read a ``copy()``."""

    @property
    def rpc_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        listener = socket.create_server(("127.0.0.1", 0), backlog=16)
        listener.setblocking(False)
        with listener:
            self.port = listener.getsockname()[1]
            log.info("tunnel %s: head endpoint on %s", self.tunnel_id, self.rpc_address)
            self.started.set()
            async with asyncio.TaskGroup() as tg:
                while True:
                    sock, _ = await loop.sock_accept(listener)
                    tg.create_task(self._connection(Link(sock=sock)))

    async def _connection(self, local: Link) -> None:
        hello = Hello(self.tunnel_id, Side.HEAD, None, self._token)
        try:
            hub = await dial_hub(self.hub, hello, self.reply_timeout)
        except TunnelError as exc:
            log.warning("tunnel %s: %s", self.tunnel_id, exc)
            local.close()  # llama-server sees its connection fail
            return
        except asyncio.CancelledError:
            local.close()
            raise
        relay = LinkRelay(
            local,
            hub,
            name=f"{self.tunnel_id}-head",
            mode=self.relay_mode,
            traffic=Traffic(turnarounds=self.turnarounds),
        )
        try:
            await relay.run()
        finally:
            self.traffic.a_to_b += relay.traffic.a_to_b
            self.traffic.b_to_a += relay.traffic.b_to_a


class StageConnector:
    """The stage worker's end: one relayed connection per ``StageWanted`` the router passes on.

    ``await connector.connect(wanted)`` returns when that connection ends; run each in the
    worker's TaskGroup. ``close()`` ends every live connection (the deployment stopped).
    """

    def __init__(
        self,
        hub: HubAddress,
        rpc_port: int,
        *,
        rpc_host: str = "127.0.0.1",
        relay_mode: RelayMode = "copy",
    ) -> None:
        self.hub, self.rpc_host, self.rpc_port = hub, rpc_host, rpc_port
        self.relay_mode = relay_mode
        self.traffic = Traffic()
        """Bytes from ggml-rpc-server to the head (a_to_b) and back, over ended connections."""
        self._live: set[LinkRelay] = set()

    async def connect(self, wanted: StageWanted) -> None:
        """Relay one head connection to the local ggml-rpc-server; TunnelError if it cannot."""
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                local = Link(sock=await connect_plain(self.rpc_host, self.rpc_port))
        except (OSError, TimeoutError) as exc:
            raise TunnelError(
                f"tunnel {wanted.tunnel_id}: ggml-rpc-server at {self.rpc_host}:{self.rpc_port} "
                f"is not reachable: {exc}"
            ) from exc
        try:
            hub = await dial_hub(self.hub, wanted.hello(), HANDSHAKE_TIMEOUT_S)
        except (TunnelError, asyncio.CancelledError):  # the local connection is ours to close
            local.close()
            raise
        relay = LinkRelay(
            local,
            hub,
            name=f"{wanted.tunnel_id}#{wanted.conn_no}-stage",
            mode=self.relay_mode,
            traffic=Traffic(),
        )
        self._live.add(relay)
        log.info("tunnel %s: stage connection %d relaying", wanted.tunnel_id, wanted.conn_no)
        try:
            await relay.run()
        finally:
            self._live.discard(relay)
            self.traffic.a_to_b += relay.traffic.a_to_b
            self.traffic.b_to_a += relay.traffic.b_to_a
        log.info("tunnel %s: stage connection %d ended", wanted.tunnel_id, wanted.conn_no)

    @property
    def live_connections(self) -> int:
        return len(self._live)

    def close(self) -> None:
        for relay in list(self._live):
            relay.close()
