"""stored_responses.py and response_store.py: what a stored response keeps, how a follow-up is
made whole, and both stores (in memory; real Redis)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest
import redis.asyncio as aioredis

from shoal.router.errors import NotFound
from shoal.router.responses.follow_ups import follow_up, input_items, prepare, stored_of
from shoal.router.responses.store.interface import ResponseStore, StoredResponse
from shoal.router.responses.store.memory import MemoryResponseStore
from shoal.router.responses.store.redis import RedisResponseStore

ANSWER = {
    "id": "resp_1",
    "object": "response",
    "status": "completed",
    "output": [
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello!"}],
        }
    ],
}


def test_a_completed_response_is_kept_with_its_conversation() -> None:
    sent = {"input": "hi", "store": True}
    stored = stored_of("key1", sent, orjson.dumps(ANSWER).decode(), None)
    assert stored is not None and stored.id == "resp_1" and stored.owner == "key1"
    assert stored.items == [{"role": "user", "content": "hi"}, *ANSWER["output"]]
    assert stored.response["store"] is True and stored.response["previous_response_id"] is None
    event = {"type": "response.completed", "response": ANSWER}
    streamed = stored_of("key1", sent, orjson.dumps(event).decode(), "resp_0")
    assert streamed is not None and streamed.items == stored.items
    assert streamed.response["previous_response_id"] == "resp_0"
    for answer in ('{"type":"response.failed"}', "[]", "not json"):
        assert stored_of("key1", sent, answer, None) is None


def test_a_follow_up_sends_the_whole_conversation() -> None:
    previous = StoredResponse(None, ANSWER, [{"role": "user", "content": "hi"}, *ANSWER["output"]])
    body = {"previous_response_id": "resp_1", "input": "and again", "model": "m"}
    sent = follow_up(body, previous)
    assert "previous_response_id" not in sent and sent["model"] == "m"
    assert sent["input"] == [*previous.items, {"role": "user", "content": "and again"}]
    assert input_items([{"role": "user", "content": "x"}, "junk"]) == [
        {"role": "user", "content": "x"}
    ]


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, redis_prefix: str) -> AsyncIterator[ResponseStore]:
    if request.param == "memory":
        yield MemoryResponseStore(ttl_s=60)
        return
    client = aioredis.Redis(host="127.0.0.1", port=6379)
    yield RedisResponseStore(client, redis_prefix, ttl_s=60)
    await client.aclose()


async def test_prepare_keeps_and_continues_only_for_its_key(store: ResponseStore) -> None:
    body, keeper = await prepare(store, "key1", {"input": "hi", "store": True})
    assert keeper is not None and body["input"] == "hi"
    await keeper.keep(orjson.dumps(ANSWER).decode())
    kept = await store.get("resp_1")
    assert kept is not None and kept.response["output"] == ANSWER["output"]

    body, keeper = await prepare(store, "key1", {"input": "more", "previous_response_id": "resp_1"})
    assert keeper is None  # not asked to be stored
    assert body["input"][-1] == {"role": "user", "content": "more"} and len(body["input"]) == 3
    with pytest.raises(NotFound):
        await prepare(store, "key2", {"input": "more", "previous_response_id": "resp_1"})
    assert await store.delete("resp_1") and not await store.delete("resp_1")
    with pytest.raises(NotFound):
        await prepare(store, "key1", {"input": "more", "previous_response_id": "resp_1"})


async def test_stored_responses_expire() -> None:
    store = MemoryResponseStore(ttl_s=0.0)
    await store.put(StoredResponse(None, ANSWER, []))
    assert await store.get("resp_1") is None
    bounded = MemoryResponseStore(ttl_s=60, max_responses=1)
    await bounded.put(StoredResponse(None, ANSWER, []))
    await bounded.put(StoredResponse(None, {**ANSWER, "id": "resp_2"}, []))
    assert await bounded.get("resp_1") is None and await bounded.get("resp_2") is not None
