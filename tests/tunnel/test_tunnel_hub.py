"""TunnelHub with HeadEndpoint and StageConnector: pairing, refusals, closing, TLS.

An echo service stands in for ggml-rpc-server here; tests/tunnel/test_tunnel_rpc.py runs the
real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import ssl
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from certs import make_certs
from shoal.tunnel.handshake import Hello, Side, StageWanted, TunnelId, new_token
from tunnel_rig import Rig, echo_server, tunnel_rig

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    server = await echo_server()
    async with server:
        yield server.sockets[0].getsockname()[1]


@pytest.fixture
async def no_leaks() -> AsyncIterator[None]:
    fds, threads = set(os.listdir("/proc/self/fd")), set(threading.enumerate())
    yield
    left = {t for t in set(threading.enumerate()) - threads if not t.name.startswith("asyncio_")}
    assert left == set(), "relay threads left running"
    assert set(os.listdir("/proc/self/fd")) - fds == set(), "file descriptors left open"


async def dial(port: int, line: bytes) -> Stream:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(line)
    return reader, writer


async def refused(rig: Rig, line: bytes) -> str:
    """What the hub answers ``line`` with; it must then close the connection."""
    reader, writer = await dial(rig.hub.port, line)
    try:
        answer = (await asyncio.wait_for(reader.readline(), 5)).decode()
        assert await asyncio.wait_for(reader.read(), 5) == b"", "the hub kept the connection"
    finally:
        writer.close()
    assert answer.startswith("ERR "), answer
    return answer[4:].strip()


async def echo_through(endpoint_port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", endpoint_port)
    writer.write(payload)
    got = await asyncio.wait_for(reader.readexactly(len(payload)), 10)
    writer.close()
    await writer.wait_closed()
    return got


async def test_head_connections_are_paired_with_stage_dial_backs(
    echo_port: int, no_leaks: None
) -> None:
    async with tunnel_rig() as rig:
        tunnel = rig.open(echo_port)
        head = await rig.head(tunnel)
        rng = random.Random(5)
        payloads = [rng.randbytes(n) for n in (1, 64, 70_000, 2_000_000)]
        for payload in payloads:
            assert await echo_through(head.port, payload) == payload
        # one stage connection per head connection, numbered in order
        assert [w.conn_no for w in rig.wanted] == [1, 2, 3, 4]
        assert all(w.tunnel_id == tunnel.id and w.token == tunnel.stage_token for w in rig.wanted)
        assert tunnel.connections == 4
        total = sum(len(p) for p in payloads)
        await wait_for(lambda: tunnel.live_connections == 0)
        assert tunnel.bytes_head_to_stage == total
        assert tunnel.bytes_stage_to_head == total
        # each echo is a request and its reply: the hub timed at least one turnaround each (a
        # big one's reply starts while it is still being sent: a turnaround per chunk then)
        assert len(tunnel.turnarounds) >= len(payloads)
        # and so did the head's end, from its side: each at least as long as the hub's part
        head_times = sorted(head.turnarounds.copy())
        assert len(head_times) >= len(payloads) and head_times[0] > 0
        assert rig.stage_errors == []
        rig.hub.close_tunnel(tunnel.id)


async def wait_for(check: object, timeout: float = 5.0) -> None:
    """Poll a condition with a deadline (the relay threads end on their own schedule)."""
    assert callable(check)
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


async def test_refusals(echo_port: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with tunnel_rig(handshake_timeout=0.3) as rig:
        tunnel = rig.open(echo_port)
        wrong = new_token()
        bad_head = Hello(tunnel.id, Side.HEAD, None, wrong).encode()
        assert await refused(rig, bad_head) == f"wrong token for the head of tunnel {tunnel.id}"
        # the head's token does not open the stage side, and vice versa
        stage_with_head_token = StageWanted(tunnel.id, 1, tunnel.head_token).hello().encode()
        assert await refused(rig, stage_with_head_token) == (
            f"wrong token for the stage of tunnel {tunnel.id}"
        )
        unknown = Hello(TunnelId("t-nope"), Side.HEAD, None, tunnel.head_token).encode()
        assert await refused(rig, unknown) == "unknown tunnel t-nope"
        assert (await refused(rig, b"GET / HTTP/1.1\r\n")).startswith("not a tunnel hello")
        assert await refused(rig, b"SHOAL-TUNNEL/1 " + b"x" * 300) == "hello line too long"
        assert await refused(rig, b"") == "no hello line in time"
        # a stage may only answer a head connection that waits for it
        late_stage = StageWanted(tunnel.id, 7, tunnel.stage_token).hello().encode()
        assert await refused(rig, late_stage) == "no head connection 7 is waiting"
        assert rig.wanted == []
        rig.hub.close_tunnel(tunnel.id)
    for token in (tunnel.head_token, tunnel.stage_token, wrong):
        assert token not in caplog.text


async def test_a_stage_that_never_dials_back_times_out(echo_port: int) -> None:
    async with tunnel_rig(stage_timeout=0.3) as rig:
        rig.deliver = False
        tunnel = rig.open(echo_port)
        answer = await refused(rig, Hello(tunnel.id, Side.HEAD, None, tunnel.head_token).encode())
        assert answer == "the stage did not connect within 0.3 s"
        # through the endpoint, llama-server's connection is closed
        head = await rig.head(tunnel)
        reader, writer = await asyncio.open_connection("127.0.0.1", head.port)
        writer.write(b"HELLO")
        with contextlib.suppress(ConnectionResetError):  # closed with our bytes unread: reset
            assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        assert [w.conn_no for w in rig.wanted] == [1, 2]


async def test_a_stage_the_router_cannot_ask_is_refused_at_once(echo_port: int) -> None:
    async with tunnel_rig(stage_timeout=30) as rig:
        rig.unavailable = "worker w-2 is not connected"
        tunnel = rig.open(echo_port)
        hello = Hello(tunnel.id, Side.HEAD, None, tunnel.head_token).encode()
        answer = await asyncio.wait_for(refused(rig, hello), 5)  # not after stage_timeout
        assert answer == "stage unavailable: worker w-2 is not connected"
        rig.hub.close_tunnel(tunnel.id)


async def test_close_tunnel_refuses_a_head_still_waiting_for_its_stage(echo_port: int) -> None:
    async with tunnel_rig(stage_timeout=30) as rig:
        rig.deliver = False
        tunnel = rig.open(echo_port)
        hello = Hello(tunnel.id, Side.HEAD, None, tunnel.head_token).encode()
        waiting = asyncio.create_task(refused(rig, hello))
        await wait_for(lambda: len(rig.wanted) == 1)
        rig.hub.close_tunnel(tunnel.id)
        assert await asyncio.wait_for(waiting, 5) == "tunnel closed"


async def test_close_tunnel_ends_live_and_refuses_new_connections(
    echo_port: int, no_leaks: None
) -> None:
    async with tunnel_rig() as rig:
        tunnel = rig.open(echo_port)
        head = await rig.head(tunnel)
        reader, writer = await asyncio.open_connection("127.0.0.1", head.port)
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
        assert tunnel.live_connections == 1
        rig.hub.close_tunnel(tunnel.id)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await writer.wait_closed()
        assert rig.hub.tunnel(tunnel.id) is None
        hello = Hello(tunnel.id, Side.HEAD, None, tunnel.head_token).encode()
        assert await refused(rig, hello) == f"unknown tunnel {tunnel.id}"
        await wait_for(lambda: rig.connectors[tunnel.id].live_connections == 0)


async def test_tls_hub(echo_port: int, tmp_path: Path, no_leaks: None) -> None:
    certs = make_certs(tmp_path / "certs")
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(certs.cert, certs.key)
    client_tls = ssl.create_default_context(cafile=str(certs.ca))
    async with tunnel_rig(server_tls=server_tls, client_tls=client_tls) as rig:
        tunnel = rig.open(echo_port)
        head = await rig.head(tunnel)
        payload = random.Random(9).randbytes(300_000)
        assert await echo_through(head.port, payload) == payload
        assert await echo_through(head.port, b"again") == b"again"
        await wait_for(lambda: tunnel.live_connections == 0)
        assert tunnel.bytes_head_to_stage == len(payload) + 5
        rig.hub.close_tunnel(tunnel.id)
