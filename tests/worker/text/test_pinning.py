"""Pinning a job to a slot asks nothing of llama-server; a POST to it survives a pooled
connection that llama-server had closed.

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
from shoal.protocol.prefix import prefix_chain
from shoal.worker.text import loopback
from shoal.worker.text.pinning import SlotPinning
from shoal.worker.text.slots import SlotTable

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


def chat(job_id: str, system: str, question: str) -> JobStart:
    return JobStart(
        job_id=JobId(job_id),
        model=ModelName("m"),
        endpoint=Endpoint.CHAT,
        stream=True,
        body={
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
        },
    )


async def test_a_job_is_pinned_by_its_content_without_asking_llama_server(
    server: tuple[ClosingServer, str],
) -> None:
    fake, url = server
    reports: list[tuple[int, ...]] = []
    table = SlotTable(2, reports.append)
    system = " ".join(f"Rule {i}: answer in one short sentence." for i in range(60))
    first, second = chat("j1", system, "Hi?"), chat("j2", system, "And you?")
    async with aiohttp.ClientSession() as session:
        pinning = SlotPinning(table, session, lambda: url)
        async with pinning.pin(first) as pin:
            assert pin is not None and pin.expected_reuse == 0
        async with pinning.pin(chat("j0", "Another tenant.", "Hi?")) as other:
            assert other is not None and other.slot != pin.slot  # the least recently used
        async with pinning.pin(second) as again:
            assert again is not None
    assert fake.connections == 0 and fake.answered == []  # no round trip before a completion
    assert again.slot == pin.slot  # the slot holding the shared system prompt
    assert again.expected_reuse > 0
    assert set(prefix_chain(second.model, second.body)) <= set(reports[-1])  # what the router sees


async def test_a_post_goes_again_after_a_stale_connection(
    server: tuple[ClosingServer, str],
) -> None:
    fake, url = server
    connector = aiohttp.TCPConnector(limit=1)  # the second call reuses the first connection
    async with aiohttp.ClientSession(connector=connector) as session:
        for path in ("/apply-template", "/tokenize"):
            async with await loopback.post(session, url + path, b"{}") as resp:
                assert resp.status == 200
                assert orjson.loads(await resp.read())  # not lost with the stale connection
    assert fake.connections == 2
    assert fake.answered == ["/apply-template", "/tokenize"]
