"""Request limits: the pure ``check_body`` by table, the bounded body reader, and both ways in
(the ASGI fast path and the documented FastAPI routes) answering 400/413 before any queueing.
The last tests serve the real router on a loopback port and talk raw HTTP to it, to show a
too-large body is refused without being read."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI
from starlette.datastructures import Headers

from shoal import serving
from shoal.protocol.messages import Endpoint
from shoal.router.admission.requests import MAX_CHOICES, RequestLimits, check_body, read_body
from shoal.router.app import build_app, serve
from shoal.router.errors import BadRequest, PayloadTooLarge
from shoal.router.routes.inference import FastPath
from shoal.router.settings import RouterSettings

DEFAULT = "default-model"
CHAT = [{"role": "user", "content": "hi"}]
LIMITS = RequestLimits(max_body_bytes=4096, max_messages=3, max_tokens=64)
OPEN = RequestLimits(max_body_bytes=4096, max_messages=3, max_tokens=None)


@pytest.fixture(autouse=True)
def key_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each router here keeps its key database in the test's own folder."""
    monkeypatch.setenv("SHOAL_DATABASE_URL", f"sqlite:///{tmp_path / 'keys.db'}")


def refusal(endpoint: Endpoint, body: dict[str, Any], limits: RequestLimits = LIMITS) -> str:
    """The param of the 400 ``check_body`` raises (and its message must be helpful)."""
    with pytest.raises(BadRequest) as info:
        check_body(endpoint, body, DEFAULT, limits)
    assert info.value.status == 400 and info.value.message
    assert info.value.param is not None
    return info.value.param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": CHAT * 4}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [1]}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": CHAT, "max_tokens": 65}, "max_tokens"),
        ({"messages": CHAT, "max_completion_tokens": 10**9}, "max_completion_tokens"),
        ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ({"messages": CHAT, "max_tokens": -1}, "max_tokens"),
        ({"messages": CHAT, "max_tokens": 2.5}, "max_tokens"),
        ({"messages": CHAT, "max_tokens": "8"}, "max_tokens"),
        ({"messages": CHAT, "max_tokens": True}, "max_tokens"),
        ({"messages": CHAT, "n_predict": 65}, "n_predict"),
        ({"messages": CHAT, "n_predict": -1}, "n_predict"),
        ({"messages": CHAT, "n": 0}, "n"),
        ({"messages": CHAT, "n": MAX_CHOICES + 1}, "n"),
        ({"messages": CHAT, "n": 1.5}, "n"),
        ({"messages": CHAT, "n": "2"}, "n"),
        ({"messages": CHAT, "stream": "yes"}, "stream"),
        ({"messages": CHAT, "model": ""}, "model"),
        ({"messages": CHAT, "model": 7}, "model"),
        ({}, "messages"),
    ],
)
def test_chat_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    assert refusal(Endpoint.CHAT, body) == param


CALL = {"type": "function", "function": {"name": "f", "arguments": "{}"}, "id": "c1"}
TOOL = {"type": "function", "function": {"name": "f", "description": "d"}}


def msg(**fields: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "hi", **fields}]


@pytest.mark.parametrize(
    ("body", "param"),
    [  # each of these made llama-server answer 500 (found by tests/e2e/test_fuzz.py)
        ({"messages": msg(name=1)}, "messages"),
        ({"messages": msg(name=None)}, "messages"),
        ({"messages": [{"role": 1, "content": "hi"}]}, "messages"),
        ({"messages": msg(tool_call_id=1)}, "messages"),
        ({"messages": msg(reasoning_content=[])}, "messages"),
        ({"messages": msg(content=1)}, "messages"),
        ({"messages": msg(content=[{"type": "text"}])}, "messages"),
        ({"messages": msg(content=[{"type": "text", "text": 1}])}, "messages"),
        ({"messages": msg(content=[{"text": "x"}])}, "messages"),
        ({"messages": msg(tool_calls=1)}, "messages"),
        ({"messages": msg(tool_calls=[{}])}, "messages"),
        ({"messages": msg(tool_calls=[{**CALL, "type": "other"}])}, "messages"),
        ({"messages": msg(tool_calls=[{**CALL, "function": {"name": "f"}}])}, "messages"),
        ({"messages": msg(tool_calls=[{**CALL, "id": 1}])}, "messages"),
        ({"messages": CHAT, "tools": 1}, "tools"),
        ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": 1}}]}, "tools"),
        (
            {"messages": CHAT, "tools": [{**TOOL, "function": {"name": "f", "description": 1}}]},
            "tools",
        ),
    ],
)
def test_malformed_messages_and_tools_are_400s(body: dict[str, Any], param: str) -> None:
    assert refusal(Endpoint.CHAT, body) == param


def test_well_formed_messages_and_tools_pass() -> None:
    messages = [
        {"role": "system", "content": "be brief", "name": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "user", "content": "thanks", "tool_calls": None},
    ]
    body = {"messages": messages, "tools": [TOOL], "max_tokens": 8}
    roomy = RequestLimits(max_messages=len(messages))
    assert check_body(Endpoint.CHAT, body, DEFAULT, roomy).body == body


def test_limit_messages_say_the_limit_and_the_flag() -> None:
    with pytest.raises(BadRequest) as too_many:
        check_body(Endpoint.CHAT, {"messages": CHAT * 4}, DEFAULT, LIMITS)
    assert "at most 3" in too_many.value.message and "--max-messages" in too_many.value.message
    with pytest.raises(BadRequest) as too_long:
        check_body(Endpoint.COMPLETIONS, {"prompt": "x", "max_tokens": 100}, DEFAULT, LIMITS)
    assert "(64" in too_long.value.message and "--max-tokens-limit" in too_long.value.message


def test_completions_are_limited_like_chat() -> None:
    assert refusal(Endpoint.COMPLETIONS, {"prompt": "x", "max_tokens": 65}) == "max_tokens"
    assert refusal(Endpoint.COMPLETIONS, {"prompt": "x", "n": 0}) == "n"
    assert refusal(Endpoint.COMPLETIONS, {"messages": CHAT}) == "prompt"


def test_a_request_within_the_limits_passes_unchanged() -> None:
    body = {"model": "m", "messages": CHAT * 3, "max_tokens": 64, "n": 2, "stream": True}
    checked = check_body(Endpoint.CHAT, body, DEFAULT, LIMITS)
    assert (checked.model, checked.stream, checked.body) == ("m", True, body)


def test_without_a_token_limit_any_positive_count_passes() -> None:
    body = {"messages": CHAT, "max_tokens": 10**6, "n_predict": -1}
    checked = check_body(Endpoint.CHAT, body, DEFAULT, OPEN)
    assert checked.model == DEFAULT and checked.body == body
    assert refusal(Endpoint.CHAT, {"messages": CHAT, "max_tokens": 0}, OPEN) == "max_tokens"


def test_the_limit_is_filled_in_when_a_request_names_none() -> None:
    body: dict[str, Any] = {"prompt": "x", "max_tokens": None}
    checked = check_body(Endpoint.COMPLETIONS, body, DEFAULT, LIMITS)
    assert checked.body == {"prompt": "x", "max_tokens": 64}
    assert body == {"prompt": "x", "max_tokens": None}, "the caller's dict is not changed"
    for named in ({"max_completion_tokens": 5}, {"n_predict": 0}):
        assert check_body(Endpoint.CHAT, {"messages": CHAT, **named}, DEFAULT, LIMITS).body == {
            "messages": CHAT,
            **named,
        }
    assert check_body(Endpoint.CHAT, {"messages": CHAT}, DEFAULT, OPEN).body == {"messages": CHAT}


def test_embeddings_ignore_generation_fields_but_not_streaming() -> None:
    body = {"input": "x", "max_tokens": 10**6}
    assert check_body(Endpoint.EMBEDDINGS, body, DEFAULT, LIMITS).body == body
    assert refusal(Endpoint.EMBEDDINGS, {"input": "x", "stream": True}) == "stream"


# ---------------------------------------------------------------- reading the body


class Chunks:
    """An async body that counts how many chunks were taken from it."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = chunks
        self.taken = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.taken += 1
            yield chunk


async def test_a_body_within_the_limit_is_read_whole() -> None:
    body = Chunks(b"a" * 10, b"b" * 10, b"")
    assert await read_body(body, Headers(), 20) == b"a" * 10 + b"b" * 10


async def test_a_declared_length_over_the_limit_is_refused_unread() -> None:
    body = Chunks(b"x")
    with pytest.raises(PayloadTooLarge) as info:
        await read_body(body, Headers({"content-length": "21"}), 20)
    assert body.taken == 0
    assert info.value.status == 413
    assert "20 bytes" in info.value.message and "--max-body-bytes" in info.value.message


async def test_a_chunked_body_is_cut_off_at_the_first_chunk_past_the_limit() -> None:
    body = Chunks(b"a" * 15, b"b" * 10, b"c" * 10, b"d" * 10)
    with pytest.raises(PayloadTooLarge):
        await read_body(body, Headers(), 20)
    assert body.taken == 2


# ---------------------------------------------------------------- through the app, in-process


def fastapi_app(app: object) -> FastAPI:
    """The FastAPI app inside the router's ASGI wrappers (the fast path first)."""
    assert isinstance(app, FastPath)
    while not isinstance(app, FastAPI):
        app = app.app  # type: ignore[attr-defined]  # each wrapper keeps the next as .app
    return app


def settings(**overrides: Any) -> RouterSettings:
    options: dict[str, Any] = {"max_body_bytes": 2048, "max_messages": 2} | overrides
    return RouterSettings(**options)


@pytest.fixture
async def clients() -> AsyncIterator[dict[str, httpx.AsyncClient]]:
    """The router's fast path, and the FastAPI routes behind it, each as an httpx client."""
    fast = build_app(settings(max_tokens_limit=16))
    made = {
        name: httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r")
        for name, app in (("fast path", fast), ("fastapi", fastapi_app(fast)))
    }
    yield made
    for client in made.values():
        await client.aclose()


async def _chunked(size: int) -> AsyncIterator[bytes]:
    for _ in range(size // 1024):
        yield b" " * 1024


@pytest.mark.parametrize("way", ["fast path", "fastapi"])
async def test_both_ways_in_refuse_what_the_limits_forbid(
    clients: dict[str, httpx.AsyncClient], way: str
) -> None:
    client = clients[way]
    big = await client.post("/v1/chat/completions", content=b" " * 4096)
    assert big.status_code == 413
    assert big.json()["error"]["code"] == "request_too_large"
    chunked = await client.post("/v1/completions", content=_chunked(8192))
    assert chunked.status_code == 413
    many = await client.post("/v1/chat/completions", json={"messages": CHAT * 3})
    assert many.status_code == 400 and many.json()["error"]["param"] == "messages"
    long = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 17})
    assert long.status_code == 400 and long.json()["error"]["param"] == "max_tokens"
    fine = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 16})
    assert fine.status_code == 404, "checked, then refused only because no worker serves it"


def test_the_openapi_document_declares_bodies_and_errors() -> None:
    schema = fastapi_app(build_app(settings())).openapi()
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["messages"]
    assert body["properties"]["messages"]["items"]["required"] == ["role", "content"]
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    for operations in schema["paths"].values():
        for operation in operations.values():
            assert "422" not in operation["responses"]
            error = operation["responses"]["default"]["content"]["application/json"]
            assert error["schema"] == {"$ref": "#/components/schemas/Error"}
    assert schema["components"]["schemas"]["Error"]["required"] == ["error"]


# ---------------------------------------------------------------- over a real socket


@pytest.fixture
async def router_port() -> AsyncIterator[int]:
    """The real router (no workers) served by uvicorn on a free loopback port."""
    sock = serving.bind("127.0.0.1", 0)
    port = int(sock.getsockname()[1])
    task = asyncio.create_task(serve(settings(), sock))
    yield port
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _exchange(port: int, head: bytes, body: bytes = b"") -> tuple[bytes, bool]:
    """Send ``head`` and ``body``; the response, and whether the server then closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        async with asyncio.timeout(10):
            response = await reader.readuntil(b"\r\n\r\n")
            length = int(response.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            response += await reader.readexactly(length)
            closed = await reader.read(1) == b""
        return response, closed
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_a_huge_declared_body_is_refused_at_once_and_the_connection_closed(
    router_port: int,
) -> None:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10000000000\r\n\r\n"
    )
    response, closed = await _exchange(router_port, head, b'{"messages": [')
    assert response.startswith(b"HTTP/1.1 413 ")
    error = orjson.loads(response.split(b"\r\n\r\n", 1)[1])["error"]
    assert "2048 bytes" in error["message"]
    assert closed, "the server must not wait for (or read) the other 10 GB"


async def test_a_chunked_body_is_refused_once_past_the_limit(router_port: int) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"400\r\n" + b" " * 1024 + b"\r\n"
    response, closed = await _exchange(router_port, head, chunk * 3)  # never terminated
    assert response.startswith(b"HTTP/1.1 413 ")
    assert closed
