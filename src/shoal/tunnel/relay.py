"""Moving bytes both ways between two connected sockets, with as little added latency as we can.

llama.cpp's RPC makes several small request/response round trips per token, so what counts is
the delay each message picks up, not bandwidth. ``benchmarks/tunnel_latency.py`` (1,000
ping-pongs of 64 bytes through one relay in its own process, 2 busy cores) measured median
round trips of 16-18 us with no relay; through blocking threads with ``recv_into``/``sendall``
41-47 us, ``os.splice`` through a pipe 44-59 us, uvloop streams 49-62 us, stdlib asyncio
streams 59-118 us (socat, for scale: about 51 us).

``SocketRelay`` is the plain-TCP relay: one blocking thread per direction, so a busy event loop
never sits between two messages. ``copy`` (``recv_into``/``sendall`` on one reused buffer) is
the default: as fast as splice for small messages and it works on every platform; ``splice``
(Linux, kernel-side copy) is there for bulk transfers. TLS sockets cannot be spliced and an
``SSLSocket`` must not be read and written from two threads, so TLS legs use ``relay_streams``,
the userspace relay on the event loop.

Either way, when one side closes its sending half, the other side's sending half is shut
(half-close is passed on); when both directions have ended, both sockets are closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

RelayMode = Literal["copy", "splice"]
BUFFER_BYTES = 1 << 16
"""Largest chunk moved per system call."""
SPLICE_AVAILABLE = hasattr(os, "splice")
TURNAROUNDS_KEPT = 256
"""The most recent request->reply turnarounds a ``Traffic`` keeps."""


@dataclass
class Traffic:
    """Bytes moved in each direction, from ``a`` to ``b`` and back. Each count has one writer.

    ``a`` asks and ``b`` answers (a head and its stage): ``turnarounds`` keeps, in
    nanoseconds, the time from the first bytes ``a`` sent after ``b``'s last reply to the
    first bytes of ``b``'s next reply, as the relay sees them: the relay->``b``->relay round
    trip plus ``b``'s work on the request (llama.cpp's RPC answers each command it must
    answer; a command that gets no answer counts towards the next one's turnaround)."""

    a_to_b: int = 0
    b_to_a: int = 0
    turnarounds: deque[int] = field(
        default_factory=lambda: deque(maxlen=TURNAROUNDS_KEPT), compare=False
    )
    asked_at: int = field(default=0, compare=False)
    """When ``a``'s unanswered request arrived (``time.monotonic_ns``; 0: none waits)."""

    def asked(self, n: int) -> None:
        """``a`` sent ``n`` bytes (called by the ``a`` -> ``b`` direction only)."""
        if not self.asked_at:
            self.asked_at = time.monotonic_ns()
        self.a_to_b += n

    def answered(self, n: int) -> None:
        """``b`` sent ``n`` bytes (called by the ``b`` -> ``a`` direction only)."""
        if asked_at := self.asked_at:
            self.turnarounds.append(time.monotonic_ns() - asked_at)
            self.asked_at = 0
        self.b_to_a += n


def tune(sock: socket.socket) -> None:
    """TCP_NODELAY: a small message leaves at once instead of waiting for more (Nagle)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class SocketRelay:
    """Relays two connected plain sockets on two threads, then closes both.

    Call ``run()`` from a coroutine (it returns when both directions have ended, and closes the
    relay if cancelled), or ``start()`` and ``join()`` from plain threads. ``close()`` ends it
    from anywhere: it shuts both sockets down, which wakes the blocked threads.
    """

    def __init__(
        self,
        a: socket.socket,
        b: socket.socket,
        *,
        name: str,
        mode: RelayMode = "copy",
        traffic: Traffic | None = None,
    ) -> None:
        if mode == "splice" and not SPLICE_AVAILABLE:
            mode = "copy"
        self.a, self.b, self.name, self.mode = a, b, name, mode
        self.traffic = traffic or Traffic()
        self._threads: list[threading.Thread] = []
        self._left = 2
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._closed = False
        self._on_done: list[asyncio.Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        for sock in (self.a, self.b):
            sock.setblocking(True)
            tune(sock)
        self._threads = [
            threading.Thread(
                target=self._pump, args=(self.a, self.b, True), name=f"{self.name}>", daemon=True
            ),
            threading.Thread(
                target=self._pump, args=(self.b, self.a, False), name=f"{self.name}<", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()

    async def run(self) -> None:
        """Relay until both directions end; on cancellation close the relay and wait for it."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._loop = loop
            self._on_done.append(done)
        self.start()
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            self.close()
            await asyncio.to_thread(self._join_threads)
            raise
        if any(thread.is_alive() for thread in self._threads):
            # The last thread resolves ``done`` just before it returns: wait for that too, so
            # no relay thread outlives ``run()``.
            await asyncio.to_thread(self._join_threads)

    def _join_threads(self) -> None:
        for thread in self._threads:
            thread.join()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for both directions to end; True if they did within ``timeout``."""
        return self._done.wait(timeout)

    def close(self) -> None:
        """End both directions now (from any thread); the threads then close the sockets."""
        with self._lock:  # never after the sockets are closed (their fds may be reused)
            if self._closed:
                return
            for sock in (self.a, self.b):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _pump(self, src: socket.socket, dst: socket.socket, forward: bool) -> None:
        try:
            if self.mode == "splice":
                self._splice(src, dst, forward)
            else:
                self._copy(src, dst, forward)
        except OSError as exc:  # reset, or shut down by close(): this direction is over
            log.debug("relay %s: direction ended (forward=%s): %s", self.name, forward, exc)
            self.close()  # a broken socket ends the other direction too
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        self._finish_one()

    def _copy(self, src: socket.socket, dst: socket.socket, forward: bool) -> None:
        buf = bytearray(BUFFER_BYTES)
        view = memoryview(buf)
        traffic = self.traffic
        while n := src.recv_into(buf):
            if forward:
                traffic.asked(n)
            else:
                traffic.answered(n)
            dst.sendall(view[:n])

    def _splice(self, src: socket.socket, dst: socket.socket, forward: bool) -> None:
        r, w = os.pipe()
        try:
            src_fd, dst_fd, traffic = src.fileno(), dst.fileno(), self.traffic
            while n := os.splice(src_fd, w, BUFFER_BYTES, flags=os.SPLICE_F_MOVE):
                if forward:
                    traffic.asked(n)
                else:
                    traffic.answered(n)
                left = n
                while left:
                    left -= os.splice(r, dst_fd, left, flags=os.SPLICE_F_MOVE)
        finally:
            os.close(r)
            os.close(w)

    def _finish_one(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left:
                return
            loop, waiters = self._loop, list(self._on_done)
            self._closed = True
            self.a.close()
            self.b.close()
        self._done.set()
        if loop is not None:
            for fut in waiters:
                with contextlib.suppress(RuntimeError):  # the loop has already closed
                    loop.call_soon_threadsafe(_resolve, fut)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def relay_streams(a: Stream, b: Stream, traffic: Traffic | None = None) -> None:
    """The userspace relay on the event loop (for TLS legs). Closes both writers at the end."""
    traffic = traffic if traffic is not None else Traffic()
    for _, writer in (a, b):
        sock = writer.get_extra_info("socket")
        if sock is not None:
            tune(sock)
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(_pump_stream(a[0], b[1], traffic, True))
            tg.create_task(_pump_stream(b[0], a[1], traffic, False))
    finally:
        for _, writer in (a, b):
            writer.close()
        for _, writer in (a, b):
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()


async def _pump_stream(
    src: asyncio.StreamReader, dst: asyncio.StreamWriter, traffic: Traffic, forward: bool
) -> None:
    try:
        while data := await src.read(BUFFER_BYTES):
            if forward:
                traffic.asked(len(data))
            else:
                traffic.answered(len(data))
            dst.write(data)
            await dst.drain()
    except (OSError, ConnectionError) as exc:  # the peer went away: this direction is over
        log.debug("stream relay direction ended: %s", exc)
        dst.close()
        return
    if dst.can_write_eof():
        with contextlib.suppress(OSError, ConnectionError):
            dst.write_eof()
    else:  # TLS has no half-close: the whole connection ends with its first direction
        dst.close()
