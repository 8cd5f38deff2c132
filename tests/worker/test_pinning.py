"""Pinning survives a pooled connection that llama-server had closed.

The server here is a fake llama-server (a few lines of raw HTTP/1.1): the real one closes a
connection after a streamed answer at a moment a test cannot choose, and this one closes its
first connection on the second request it reads there, without answering, every time. From
the client's side that is the stale connection the worker meets.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import Endpoint, JobStart
from shoal.worker.pinning import SlotPinning
from shoal.worker.slots import SlotTable

TOKENS = list(range(40))
PROMPT = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


class ClosingServer:
    """Answers ``/apply-template`` and ``/tokenize``; drops its first connection when a second
    request arrives on it."""

    def __init__(self) -> None:
        self.connections = 0
        self.answered: list[str] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        first = self.connections == 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                if first and served == 1:
                    return  # closed without an answer: the pooled connection was stale
                body = orjson.dumps(
                    {"prompt": PROMPT} if path == "/apply-template" else {"tokens": TOKENS}
                )
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
                self.answered.append(path)
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def server() -> AsyncIterator[tuple[ClosingServer, str]]:
    fake = ClosingServer()
    srv = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    async with srv:
        yield fake, f"http://127.0.0.1:{port}"


async def test_a_job_is_pinned_by_its_tokens_after_a_stale_connection(
    server: tuple[ClosingServer, str],
) -> None:
    fake, url = server
    table = SlotTable(2, lambda _: None)
    job = JobStart(
        job_id=JobId("j1"),
        model=ModelName("m"),
        endpoint=Endpoint.CHAT,
        stream=True,
        body={"messages": [{"role": "user", "content": "hello"}]},
    )
    connector = aiohttp.TCPConnector(limit=1)  # the second call reuses the first connection
    async with aiohttp.ClientSession(connector=connector) as session:
        pinning = SlotPinning(table, session, lambda: url)
        async with pinning.pin(job) as pin:
            assert pin is not None
            assert pin.prompt_tokens == len(TOKENS)  # not 0: the tokenize call was posted again
    assert fake.connections == 2
    assert fake.answered == ["/apply-template", "/tokenize"]
    assert len(table.slots[pin.slot].blocks) == len(TOKENS) // 16
