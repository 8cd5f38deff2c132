"""The result cache: which requests are cacheable and their keys (tables), the LRU and its
TTL, the Redis backend (real Redis on loopback, a key prefix per test), replay in both modes
through a tiny app, and the fill the relay drives."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from shoal.protocol.messages import Endpoint
from shoal.redis_queue.keys import cache_entry_key
from shoal.router.admission.result_cache.interface import (
    CACHE_HEADER,
    HIT,
    CachedAnswer,
    CacheFill,
    ResultCache,
    answer_mode,
    cache_key,
    cache_policy,
    is_deterministic,
    json_bytes,
    replay,
    sse_bytes,
)
from shoal.router.admission.result_cache.memory import MemoryResultCache
from shoal.router.admission.result_cache.redis import RedisResultCache

REDIS_URL = "redis://127.0.0.1:6379/0"
CHAT = [{"role": "user", "content": "hi"}]
GREEDY = {"messages": CHAT, "temperature": 0}
BODY = '{"object":"chat.completion","choices":[{"message":{"content":"hello"}}]}'
EVENTS = (
    '{"choices":[{"delta":{"content":"hel"}}]}',
    '{"choices":[{"delta":{"content":"lo"},"finish_reason":"stop"}]}',
)


# ---------------------------------------------------------------- which requests are cacheable


@pytest.mark.parametrize(
    ("endpoint", "body", "cacheable"),
    [
        (Endpoint.CHAT, {"messages": CHAT, "temperature": 0}, True),
        (Endpoint.CHAT, {"messages": CHAT, "temperature": 0.0}, True),
        (Endpoint.CHAT, {"messages": CHAT, "temperature": 0, "n": 3}, True),  # same 3 choices
        (Endpoint.CHAT, {"messages": CHAT, "temperature": -1}, True),  # llama.cpp: greedy
        (Endpoint.CHAT, {"messages": CHAT}, False),  # the backend's default samples
        (Endpoint.CHAT, {"messages": CHAT, "temperature": 0.7}, False),
        (Endpoint.CHAT, {"messages": CHAT, "temperature": None}, False),
        (Endpoint.CHAT, {"messages": CHAT, "temperature": False}, False),  # not a number
        (Endpoint.CHAT, {"messages": CHAT, "temperature": "0"}, False),
        (Endpoint.CHAT, {"messages": CHAT, "seed": 42}, True),
        (Endpoint.CHAT, {"messages": CHAT, "temperature": 1.2, "seed": 0}, True),
        (Endpoint.CHAT, {"messages": CHAT, "temperature": 1.2, "seed": 42, "n": 1}, True),
        (Endpoint.CHAT, {"messages": CHAT, "temperature": 1.2, "seed": 42, "n": None}, True),
        (Endpoint.CHAT, {"messages": CHAT, "temperature": 1.2, "seed": 42, "n": 2}, False),
        (Endpoint.CHAT, {"messages": CHAT, "seed": -1}, False),  # llama.cpp: random seed
        (Endpoint.CHAT, {"messages": CHAT, "seed": 4.2}, False),
        (Endpoint.CHAT, {"messages": CHAT, "seed": True}, False),
        (Endpoint.CHAT, {"messages": CHAT, "seed": 42, "n": True}, False),
        (Endpoint.COMPLETIONS, {"prompt": "x", "temperature": 0, "stream": True}, True),
        (Endpoint.COMPLETIONS, {"prompt": "x", "temperature": 0.1}, False),
        (Endpoint.EMBEDDINGS, {"input": "x"}, True),  # no sampling at all
    ],
)
def test_which_requests_are_deterministic(
    endpoint: Endpoint, body: dict[str, Any], cacheable: bool
) -> None:
    assert is_deterministic(endpoint, body) is cacheable
    assert (cache_key("m", endpoint, body) is not None) is cacheable


def key(body: dict[str, Any], model: str = "m", endpoint: Endpoint = Endpoint.CHAT) -> str:
    found = cache_key(model, endpoint, body)
    assert found is not None
    return found


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (GREEDY, {"temperature": 0, "messages": CHAT}),  # key order
        (
            {"messages": CHAT, "temperature": 0, "response_format": {"type": "json", "x": 1}},
            {"messages": CHAT, "temperature": 0, "response_format": {"x": 1, "type": "json"}},
        ),  # nested key order
        (GREEDY, {**GREEDY, "user": "alice"}),
        (GREEDY, {**GREEDY, "model": "m"}),  # the model counts once, resolved
        (GREEDY, {**GREEDY, "stream": False}),
        (GREEDY, {**GREEDY, "stream_options": {"include_usage": True}}),  # ignored unstreamed
        ({**GREEDY, "stream": True}, {**GREEDY, "stream": True, "stream_options": {}}),
    ],
)
def test_equivalent_requests_share_a_key(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert key(a) == key(b)


@pytest.mark.parametrize(
    "other",
    [
        {"messages": [{"role": "user", "content": "hi!"}], "temperature": 0},
        {**GREEDY, "max_tokens": 5},
        {**GREEDY, "temperature": 0.0},  # 0 and 0.0 are different JSON
        {**GREEDY, "seed": 1},
        {**GREEDY, "stream": True},  # a stream is other bytes than a JSON body
        {**GREEDY, "stream": True, "stream_options": {"include_usage": True}},
    ],
)
def test_different_requests_get_different_keys(other: dict[str, Any]) -> None:
    assert key(GREEDY) != key(other)


def test_model_endpoint_and_scope_are_part_of_the_key() -> None:
    body = {"prompt": "x", "temperature": 0}
    base = key(body, endpoint=Endpoint.COMPLETIONS)
    assert base != key(body, model="other", endpoint=Endpoint.COMPLETIONS)
    assert base != key(body, endpoint=Endpoint.CHAT)
    scoped = cache_key("m", Endpoint.COMPLETIONS, body, scope="key-a")
    assert scoped not in (base, cache_key("m", Endpoint.COMPLETIONS, body, scope="key-b"))
    assert len(base) == 64 and int(base, 16) >= 0  # SHA-256, hex


def test_modes() -> None:
    assert answer_mode(GREEDY) == answer_mode({**GREEDY, "stream_options": {"x": 1}}) == "json"
    assert answer_mode({**GREEDY, "stream": True}) == "sse"
    streamed = {**GREEDY, "stream": True, "stream_options": {"include_usage": True}}
    assert answer_mode(streamed) == 'sse{"include_usage":true}'


@pytest.mark.parametrize(
    ("header", "read", "write"),
    [
        (None, True, True),
        ("no-cache", False, True),
        ("max-age=0, No-Cache", False, True),
        ("no-store", False, False),
        ("no-cache,no-store", False, False),
        ("max-age=60", True, True),
    ],
)
def test_cache_control(header: str | None, read: bool, write: bool) -> None:
    policy = cache_policy({} if header is None else {"cache-control": header})
    assert (policy.read, policy.write) == (read, write)


# ---------------------------------------------------------------- entries and replay


def test_an_answer_is_a_body_or_events() -> None:
    with pytest.raises(ValueError):
        CachedAnswer()
    with pytest.raises(ValueError):
        CachedAnswer(body=BODY, events=EVENTS)
    for answer in (CachedAnswer(body=BODY), CachedAnswer(events=EVENTS), CachedAnswer(events=())):
        assert CachedAnswer.loads(answer.dumps()) == answer
    for damaged in (b"{", b"[]", b'{"v": 99, "body": "x"}', b'{"v": 1, "events": [1]}'):
        assert CachedAnswer.loads(damaged) is None


def test_replay_bytes() -> None:
    streamed = CachedAnswer(events=EVENTS)
    assert sse_bytes(streamed) == (
        b"data: " + EVENTS[0].encode() + b"\n\n"
        b"data: " + EVENTS[1].encode() + b"\n\n"
        b"data: [DONE]\n\n"
    )
    assert json_bytes(CachedAnswer(body=BODY)) == BODY.encode()
    with pytest.raises(ValueError):
        sse_bytes(CachedAnswer(body=BODY))
    with pytest.raises(ValueError):
        json_bytes(streamed)


async def _answer(request: Request) -> Response:
    stream = request.query_params.get("stream") == "1"
    answer = CachedAnswer(events=EVENTS) if stream else CachedAnswer(body=BODY)
    return replay(answer, stream=stream)


@pytest.fixture
async def replay_client() -> AsyncIterator[httpx.AsyncClient]:
    app = Starlette(routes=[Route("/answer", _answer)])
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://router"
    ) as client:
        yield client


async def test_a_json_hit_replays_the_body(replay_client: httpx.AsyncClient) -> None:
    reply = await replay_client.get("/answer")
    assert reply.headers[CACHE_HEADER] == HIT
    assert reply.headers["content-type"] == "application/json"
    assert reply.headers["x-request-id"].startswith("cache_")
    assert reply.json() == orjson.loads(BODY)


async def test_a_streamed_hit_streams(replay_client: httpx.AsyncClient) -> None:
    async with replay_client.stream("GET", "/answer?stream=1") as reply:
        assert reply.headers[CACHE_HEADER] == HIT
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in reply.aiter_lines() if line]
    assert lines == [f"data: {EVENTS[0]}", f"data: {EVENTS[1]}", "data: [DONE]"]
    other = await replay_client.get("/answer?stream=1")
    assert other.headers["x-request-id"] != reply.headers["x-request-id"]  # fresh per reply


# ---------------------------------------------------------------- the memory LRU


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_lru_evicts_the_least_recently_used() -> None:
    cache = MemoryResultCache(max_entries=2, ttl_s=60.0)
    a, b, c = (CachedAnswer(body=f'{{"n":{i}}}') for i in range(3))
    await cache.put("a", a)
    await cache.put("b", b)
    assert await cache.get("a") == a  # now "b" is the least recently used
    await cache.put("c", c)
    assert len(cache) == 2
    assert await cache.get("b") is None
    assert await cache.get("a") == a and await cache.get("c") == c


async def test_lru_bounds_the_characters_held() -> None:
    cache = MemoryResultCache(max_entries=10, ttl_s=60.0, max_chars=25)
    await cache.put("a", CachedAnswer(body="x" * 10))
    await cache.put("b", CachedAnswer(body="y" * 10))
    await cache.put("c", CachedAnswer(body="z" * 10))  # 30 > 25: "a" goes
    assert await cache.get("a") is None and cache.chars == 20
    await cache.put("huge", CachedAnswer(body="h" * 26))  # larger than the whole cache
    assert await cache.get("huge") is None and len(cache) == 2
    await cache.put("b", CachedAnswer(body="w" * 5))  # replacing counts the new size
    assert cache.chars == 15


async def test_lru_entries_expire() -> None:
    clock = Clock()
    cache = MemoryResultCache(max_entries=4, ttl_s=30.0, clock=clock)
    await cache.put("k", CachedAnswer(body=BODY))
    clock.now += 29.9
    assert await cache.get("k") is not None
    clock.now += 0.1
    assert await cache.get("k") is None and len(cache) == 0 and cache.chars == 0


# ---------------------------------------------------------------- Redis


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def prefix(redis_client: aioredis.Redis) -> AsyncIterator[str]:
    """A Redis key prefix of this test alone; its keys are deleted afterwards."""
    name = f"test-cache-{uuid.uuid4().hex}:"
    yield name
    keys = [k async for k in redis_client.scan_iter(match=name + "*")]
    if keys:
        await redis_client.delete(*keys)


async def test_redis_cache_round_trip_and_ttl(redis_client: aioredis.Redis, prefix: str) -> None:
    cache = RedisResultCache(redis_client, prefix, ttl_s=30.0)
    k = key(GREEDY)
    assert await cache.get(k) is None
    await cache.put(k, CachedAnswer(events=EVENTS))
    assert await cache.get(k) == CachedAnswer(events=EVENTS)
    assert 29_000 < await redis_client.pttl(cache_entry_key(prefix, k)) <= 30_000
    short = RedisResultCache(redis_client, prefix, ttl_s=0.05)
    await short.put("brief", CachedAnswer(body=BODY))
    assert await short.get("brief") == CachedAnswer(body=BODY)
    await asyncio.sleep(0.15)  # real time must pass for Redis to expire the key
    assert await short.get("brief") is None


async def test_redis_cache_ignores_damaged_entries(
    redis_client: aioredis.Redis, prefix: str
) -> None:
    cache = RedisResultCache(redis_client, prefix, ttl_s=30.0)
    await redis_client.set(cache_entry_key(prefix, "bad"), b"not json")
    assert await cache.get("bad") is None


async def test_an_unreachable_redis_is_a_miss(caplog: pytest.LogCaptureFixture) -> None:
    # Port 1 on loopback: nothing listens there, so the connection is refused at once.
    client = aioredis.Redis.from_url("redis://127.0.0.1:1/0")
    try:
        cache = RedisResultCache(client, "x:", ttl_s=30.0)
        await cache.put("k", CachedAnswer(body=BODY))
        assert await cache.get("k") is None
        assert await cache.get("k") is None
    finally:
        await client.aclose()
    outages = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(outages) == 1  # logged once per outage, not per call


# ---------------------------------------------------------------- filling from the relay


@pytest.fixture(params=["memory", "redis"])
def cache(request: pytest.FixtureRequest, redis_client: aioredis.Redis, prefix: str) -> ResultCache:
    if request.param == "memory":
        return MemoryResultCache(max_entries=8, ttl_s=60.0)
    return RedisResultCache(redis_client, prefix, ttl_s=60.0)


async def test_a_finished_stream_is_stored_and_replayed(cache: ResultCache) -> None:
    fill = CacheFill(cache, "s", stream=True)
    for event in EVENTS:
        fill.data(event)
    assert await cache.get("s") is None  # nothing until the stream ends with Done
    await fill.finish_stream()
    stored = await cache.get("s")
    assert stored is not None and stored.events == EVENTS
    assert replay(stored, stream=True).body == sse_bytes(CachedAnswer(events=EVENTS))


async def test_a_body_is_stored(cache: ResultCache) -> None:
    await CacheFill(cache, "j", stream=False).finish_body(BODY)
    stored = await cache.get("j")
    assert stored is not None and replay(stored, stream=False).body == BODY.encode()


async def test_unfinished_or_oversized_answers_are_not_stored(cache: ResultCache) -> None:
    broken = CacheFill(cache, "broken", stream=True)
    broken.data(EVENTS[0])  # then the job Failed: the relay never calls finish_stream
    big = CacheFill(cache, "big", stream=True, max_chars=len(EVENTS[0]) + 1)
    for event in EVENTS:
        big.data(event)
    await big.finish_stream()
    large_body = CacheFill(cache, "large", stream=False, max_chars=10)
    await large_body.finish_body(BODY)
    wrong_mode = CacheFill(cache, "mode", stream=True)
    await wrong_mode.finish_body(BODY)
    for name in ("broken", "big", "large", "mode"):
        assert await cache.get(name) is None, name
