"""SocketRelay and relay_streams: bytes arrive intact both ways, half-close passes through,
and closing leaves no thread or file descriptor behind."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
from collections.abc import AsyncIterator

import pytest

from shoal.tunnel.relay import SocketRelay, Traffic, relay_streams


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
async def no_leaks() -> AsyncIterator[None]:
    """Async so that the event loop's own descriptors exist before the snapshot."""
    fds, threads = open_fds(), set(threading.enumerate())
    yield
    left = {t for t in set(threading.enumerate()) - threads if not t.name.startswith("asyncio_")}
    assert left == set(), "relay threads left running"
    assert open_fds() - fds == set(), "file descriptors left open"


def relayed_pair(mode: str) -> tuple[socket.socket, socket.socket, SocketRelay]:
    """client <-> [a | relay | b] <-> server: returns (client, server, relay), started."""
    client, a = socket.socketpair()
    b, server = socket.socketpair()
    relay = SocketRelay(a, b, name="test", mode=mode)  # type: ignore[arg-type]
    relay.start()
    return client, server, relay


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, f"closed after {len(buf)} of {n} bytes"
        buf += chunk
    return bytes(buf)


@pytest.mark.parametrize("mode", ["copy", "splice"])
def test_random_payloads_both_ways(mode: str, no_leaks: None) -> None:
    client, server, relay = relayed_pair(mode)
    rng = random.Random(7)
    sizes = [1, 64, 1000, 65_536, 65_537, 3_000_000] + [rng.randint(1, 5000) for _ in range(50)]
    with client, server:
        for size in sizes:
            up, down = rng.randbytes(size), rng.randbytes(size // 2 + 1)
            sender = threading.Thread(target=client.sendall, args=(up,))
            sender.start()  # a 3 MB message does not fit the socket buffers: send while reading
            assert recv_exactly(server, size) == up
            sender.join()
            sender = threading.Thread(target=server.sendall, args=(down,))
            sender.start()
            assert recv_exactly(client, len(down)) == down
            sender.join()
    assert relay.join(5)
    assert relay.traffic == Traffic(sum(sizes), sum(s // 2 + 1 for s in sizes))
    # Every request got its reply before the next: one turnaround each, all positive.
    turnarounds = list(relay.traffic.turnarounds)
    assert len(turnarounds) == len(sizes) and all(t > 0 for t in turnarounds)


@pytest.mark.parametrize("mode", ["copy", "splice"])
def test_half_close_passes_through(mode: str, no_leaks: None) -> None:
    client, server, relay = relayed_pair(mode)
    with client, server:
        client.sendall(b"request")
        client.shutdown(socket.SHUT_WR)
        assert recv_exactly(server, 7) == b"request"
        assert server.recv(10) == b""  # the client's end-of-stream arrived
        server.sendall(b"answer after the client's half-close")  # the other way still works
        assert recv_exactly(client, 36) == b"answer after the client's half-close"
        assert not relay.done
        server.close()
        assert client.recv(10) == b""
    assert relay.join(5)


@pytest.mark.parametrize("mode", ["copy", "splice"])
def test_close_ends_both_directions(mode: str, no_leaks: None) -> None:
    client, server, relay = relayed_pair(mode)
    with client, server:
        relay.close()
        assert relay.join(5)
        assert client.recv(10) == b""
        assert server.recv(10) == b""
    assert relay.a.fileno() == -1 and relay.b.fileno() == -1


def test_relay_ends_when_both_sides_have_closed(no_leaks: None) -> None:
    client, server, relay = relayed_pair("copy")
    client.close()
    assert server.recv(10) == b""
    assert not relay.join(0.1)  # half-closed: the server may still answer
    server.close()
    assert relay.join(5)


async def test_run_returns_and_cancel_closes(no_leaks: None) -> None:
    client, server, relay = relayed_pair("copy")
    relay2_client, a = socket.socketpair()
    b, relay2_server = socket.socketpair()
    relay2 = SocketRelay(a, b, name="cancelled")
    with client, server, relay2_client, relay2_server:
        task = asyncio.create_task(relay2.run())
        await asyncio.sleep(0)  # let run() start its threads
        relay2_client.sendall(b"x")
        assert await asyncio.to_thread(recv_exactly, relay2_server, 1) == b"x"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert relay2.done and relay2_server.recv(1) == b""
        client.close()
        server.close()
        await asyncio.wait_for(asyncio.to_thread(relay.join), 5)


async def test_stream_relay_both_ways_and_close(no_leaks: None) -> None:
    """The userspace relay (used for TLS legs), here on plain sockets."""
    client, a = socket.socketpair()
    b, server = socket.socketpair()
    for s in (client, server):
        s.setblocking(False)
    traffic = Traffic()
    sa, sb = await asyncio.open_connection(sock=a), await asyncio.open_connection(sock=b)
    c_r, c_w = await asyncio.open_connection(sock=client)
    s_r, s_w = await asyncio.open_connection(sock=server)
    task = asyncio.create_task(relay_streams(sa, sb, traffic))
    payload = random.Random(3).randbytes(500_000)
    c_w.write(payload)
    assert await s_r.readexactly(len(payload)) == payload
    s_w.write(b"pong")
    assert await c_r.readexactly(4) == b"pong"
    c_w.close()
    assert await s_r.read() == b""
    s_w.close()
    await asyncio.wait_for(task, 5)
    assert traffic == Traffic(len(payload), 4)
    await c_w.wait_closed()
    await s_w.wait_closed()


def test_turnarounds_time_each_request_to_the_first_byte_of_its_reply() -> None:
    traffic = Traffic()
    traffic.answered(10)  # a reply nobody asked for (the stage speaks first): not timed
    traffic.asked(5)
    traffic.asked(5)  # the same request, a second chunk: still the first one's time
    asked_at = traffic.asked_at
    traffic.answered(3)
    traffic.answered(3)  # the rest of the reply: not a new turnaround
    assert len(traffic.turnarounds) == 1 and traffic.asked_at == 0 and asked_at > 0
    assert (traffic.a_to_b, traffic.b_to_a) == (10, 16)
