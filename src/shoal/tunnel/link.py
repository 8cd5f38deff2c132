"""One tunnel connection during its handshake, and the relay it ends in.

A ``Link`` is either a plain socket (read with the event loop's socket calls while the hello
line is exchanged, then handed to a ``SocketRelay`` thread pair) or a TLS connection as asyncio
streams (relayed on the event loop). ``LinkRelay`` picks the relay: threads when both links are
plain, the stream relay otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from shoal.tunnel.handshake import split_line
from shoal.tunnel.relay import RelayMode, SocketRelay, Stream, Traffic, relay_streams, tune

_RECV_BYTES = 4096


class Link:
    """A connected socket, plain or TLS, with the bytes read past its hello line."""

    def __init__(self, sock: socket.socket | None = None, stream: Stream | None = None) -> None:
        assert (sock is None) != (stream is None), "a link is a socket or a stream, not both"
        self.sock, self.stream = sock, stream
        self.pending = b""
        if sock is not None:
            sock.setblocking(False)
            tune(sock)

    async def read_line(self) -> bytes:
        """The next line (HandshakeError if too long); bytes after it stay in ``pending``.

        Raises ConnectionError if the peer closes first. Callers bound it with a timeout.
        """
        buffer = self.pending
        while (found := split_line(buffer)) is None:
            chunk = await self._recv()
            if not chunk:
                raise ConnectionError("closed before the end of the line")
            buffer += chunk
        line, self.pending = found
        return line

    async def _recv(self) -> bytes:
        if self.sock is not None:
            return await asyncio.get_running_loop().sock_recv(self.sock, _RECV_BYTES)
        assert self.stream is not None
        return await self.stream[0].read(_RECV_BYTES)

    async def send(self, data: bytes) -> None:
        if self.sock is not None:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)
        else:
            assert self.stream is not None
            self.stream[1].write(data)
            await self.stream[1].drain()

    async def refuse(self, line: bytes) -> None:
        """Send a last line (an ``ERR``) if the peer still listens, then close."""
        with contextlib.suppress(OSError, ConnectionError):
            async with asyncio.timeout(1.0):
                await self.send(line)
        await self.aclose()

    def close(self) -> None:
        """Close now (idempotent): for the ``finally`` of a task that may be cancelled."""
        if self.sock is not None:
            self.sock.close()
        elif self.stream is not None:
            self.stream[1].close()

    async def aclose(self) -> None:
        self.close()
        if self.stream is not None:
            with contextlib.suppress(OSError, ConnectionError):
                await self.stream[1].wait_closed()

    async def as_stream(self) -> Stream:
        if self.stream is not None:
            return self.stream
        assert self.sock is not None
        return await asyncio.open_connection(sock=self.sock)


class LinkRelay:
    """Relays two links after their handshake, bytes read past a hello line first."""

    def __init__(
        self, a: Link, b: Link, *, name: str, mode: RelayMode = "copy", traffic: Traffic
    ) -> None:
        self.a, self.b, self.name, self.mode, self.traffic = a, b, name, mode, traffic
        self._sockets: SocketRelay | None = None
        self._streams: list[Stream] = []
        self._closed = False

    async def run(self) -> None:
        """Relay until both sides close (or ``close()``); both links are closed at the end."""
        try:
            await self._flush_pending()
            if self._closed:
                return
            if self.a.sock is not None and self.b.sock is not None:
                self._sockets = SocketRelay(
                    self.a.sock, self.b.sock, name=self.name, mode=self.mode, traffic=self.traffic
                )
                await self._sockets.run()
            else:
                self._streams = [await self.a.as_stream(), await self.b.as_stream()]
                if not self._closed:
                    await relay_streams(self._streams[0], self._streams[1], self.traffic)
        finally:
            await self.a.aclose()
            await self.b.aclose()

    async def _flush_pending(self) -> None:
        if self.a.pending:
            data, self.a.pending = self.a.pending, b""
            self.traffic.asked(len(data))
            await self.b.send(data)
        if self.b.pending:
            data, self.b.pending = self.b.pending, b""
            self.traffic.answered(len(data))
            await self.a.send(data)

    def close(self) -> None:
        """End the relay from the event loop's thread; ``run()`` then returns."""
        self._closed = True
        if self._sockets is not None:
            self._sockets.close()
        for _, writer in self._streams:
            writer.transport.abort()
