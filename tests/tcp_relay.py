"""A TCP relay that holds what the server sends for a moment, then passes it on in one piece.

What a slow or buffering link (a WAN, a proxy) does to a reply written in several pieces: a
router that answers a worker's handshake and refuses it at once (``101``, ``refused``, close)
reaches the worker as one read, so the worker sees the close before it has sent anything.
Only the first burst is held; the rest, and the client's side, pass at once.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

CHUNK = 65536


@contextlib.contextmanager
def holding_relay(target_port: int, hold_s: float = 0.5) -> Iterator[int]:
    """A relay to ``127.0.0.1:target_port`` for as long as the block runs; yields its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    threads: list[threading.Thread] = []
    sockets: list[socket.socket] = [listener]

    def start(target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        threads.append(thread)

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed: the block ended
            upstream = socket.create_connection(("127.0.0.1", target_port))
            sockets.extend((client, upstream))
            start(_copy, client, upstream)
            start(_copy_holding_first, upstream, client, hold_s)

    start(accept)
    try:
        yield listener.getsockname()[1]
    finally:
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for thread in threads:
            thread.join(5)


def _copy(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(CHUNK):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def _copy_holding_first(source: socket.socket, sink: socket.socket, hold_s: float) -> None:
    """Gather what arrives in the first ``hold_s`` seconds after the first byte, send it as
    one write, then copy as it comes."""
    held = bytearray()
    with contextlib.suppress(OSError):
        first = source.recv(CHUNK)
        if not first:
            sink.shutdown(socket.SHUT_WR)
            return
        held += first
        deadline = time.monotonic() + hold_s
        while (left := deadline - time.monotonic()) > 0:
            source.settimeout(left)
            try:
                data = source.recv(CHUNK)
            except TimeoutError:
                break
            if not data:
                break
            held += data
        source.settimeout(None)
        sink.sendall(bytes(held))
    _copy(source, sink)
