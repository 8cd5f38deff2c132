"""The OpenAI-compatible API through a real router and two real workers running llama-server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

import http_calls
from cluster import API_KEY, MODEL, Cluster, Router

pytestmark = pytest.mark.e2e

HELLO = [{"role": "user", "content": "Say hello in one word."}]


@dataclass
class Shared:
    router: Router
    client: openai.OpenAI


@pytest.fixture(scope="module")
def shared(session_cluster: Cluster) -> Iterator[Shared]:
    router = session_cluster.router()
    session_cluster.worker(router, "--slots", "2", "--ctx-size", "2048", name="w1")
    session_cluster.worker(router, "--slots", "2", "--ctx-size", "2048", name="w2")
    router.wait_workers(2)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0)
    yield Shared(router, client)
    client.close()


def test_chat_non_streaming(shared: Shared) -> None:
    r = shared.client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8)
    assert r.model == MODEL
    assert r.object == "chat.completion"
    assert r.choices[0].message.content
    assert r.usage is not None and r.usage.completion_tokens > 0


def test_chat_streaming_with_usage(shared: Shared) -> None:
    stream = shared.client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert all(c.model == MODEL for c in chunks)
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens > 0 and not chunks[-1].choices


def test_completions_both_ways(shared: Shared) -> None:
    r = shared.client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert r.model == MODEL and r.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in shared.client.completions.create(
            model=MODEL,
            prompt="The capital of France is",
            max_tokens=6,
            temperature=0,
            stream=True,
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_models_lists_the_served_model(shared: Shared) -> None:
    models = shared.client.models.list()
    ids = [m.id for m in models]
    assert ids == [MODEL]
    assert shared.client.models.retrieve(MODEL).id == MODEL


def test_parameters_pass_through(shared: Shared) -> None:
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=0.9, seed=42)
    a = shared.client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    b = shared.client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    assert a.choices[0].message.content == b.choices[0].message.content
    lp = shared.client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=3, logprobs=True, top_logprobs=2
    )
    assert lp.choices[0].logprobs is not None
    assert len(lp.choices[0].logprobs.content or []) == 3
    stop = shared.client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[","]
    )
    assert "," not in stop.choices[0].text
    assert stop.choices[0].finish_reason == "stop"


def test_json_response_format_passes_through(shared: Shared) -> None:
    r = shared.client.chat.completions.create(
        model=MODEL,
        max_tokens=60,
        temperature=0,
        messages=[{"role": "user", "content": "Give a JSON object with a key name."}],
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "n",
                "schema": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 10}},
                    "required": ["name"],
                },
            },
        },
    )
    import json

    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


async def test_two_workers_serve_parallel_streams(shared: Shared) -> None:
    aclient = openai.AsyncOpenAI(base_url=shared.router.url + "/v1", api_key=API_KEY)

    async def one(i: int) -> tuple[str, str]:
        raw = await aclient.chat.completions.with_raw_response.create(
            model=MODEL, messages=HELLO, max_tokens=16, stream=True
        )
        text = ""
        async for chunk in raw.parse():
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return raw.headers["x-shoal-worker"], text

    async with aclient:
        results = await asyncio.gather(*(one(i) for i in range(4)))
    workers = {w for w, _ in results}
    assert len(workers) == 2, results
    assert all(text for _, text in results)


class TestErrors:
    def test_malformed_json_is_400(self, shared: Shared) -> None:
        r = http_calls.post(
            shared.router.url + "/v1/chat/completions",
            content=b"{not json",
            headers={**shared.router.headers, "Content-Type": "application/json"},
        )
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "not valid JSON" in err["message"]

    def test_missing_messages_is_400(self, shared: Shared) -> None:
        with pytest.raises(openai.BadRequestError, match="messages"):
            shared.client.chat.completions.create(model=MODEL, messages=[])

    def test_bad_key_is_401(self, shared: Shared) -> None:
        bad = openai.OpenAI(base_url=shared.router.url + "/v1", api_key="wrong", max_retries=0)
        with bad, pytest.raises(openai.AuthenticationError) as info:
            bad.chat.completions.create(model=MODEL, messages=HELLO)
        assert info.value.code == "invalid_api_key"
        r = http_calls.get(shared.router.url + "/v1/models")
        assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]

    def test_unknown_model_is_404(self, shared: Shared) -> None:
        with pytest.raises(openai.NotFoundError) as info:
            shared.client.chat.completions.create(model="no-such-model", messages=HELLO)
        assert info.value.code == "model_not_found"
        assert MODEL in str(info.value)

    def test_embeddings_on_a_chat_model_is_400(self, shared: Shared) -> None:
        with pytest.raises(openai.BadRequestError, match="--embedding"):
            shared.client.embeddings.create(model=MODEL, input="hello")

    def test_unknown_path_is_404_json(self, shared: Shared) -> None:
        r = http_calls.get(shared.router.url + "/v1/nothing-here")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"

    def test_backend_error_passes_through(self, shared: Shared) -> None:
        # A grammar llama-server cannot parse: its own 400 reaches the client. (A prompt longer
        # than every slot's context no longer does: the router answers that one itself,
        # tests/e2e/test_context.py.)
        with pytest.raises(openai.BadRequestError) as info:
            shared.client.completions.create(
                model=MODEL, prompt="hello", max_tokens=2, extra_body={"grammar": "root ::= ("}
            )
        assert info.value.status_code == 400
        assert "failed to parse grammar" in info.value.response.json()["error"]["message"]
        # Its code as llama-server (like OpenAI) sends it: a number (it was turned into "400";
        # the openai client makes a string of either, so the body is read).
        assert info.value.response.json()["error"]["code"] == 400
        # Named like an answer: the job's id, and the worker that answered with the error.
        headers = info.value.response.headers
        assert info.value.request_id is not None and info.value.request_id.startswith("job_")
        workers = {w["id"] for w in shared.router.workers()}
        assert headers.get("x-shoal-worker") in workers, dict(headers)

    def test_a_request_refused_before_it_is_queued_has_a_request_id(self, shared: Shared) -> None:
        url = shared.router.url + "/v1/chat/completions"
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
        json_headers = {**shared.router.headers, "Content-Type": "application/json"}
        refused = [
            http_calls.post(url, json={**body, "model": "no-such-model"}, headers=json_headers),
            http_calls.post(url, content=b"{not json", headers=json_headers),
            http_calls.post(url, json=body),  # no key
            http_calls.get(shared.router.url + "/v1/models/no-such-model", headers=json_headers),
        ]
        assert [r.status_code for r in refused] == [404, 400, 401, 404]
        ids = [r.headers.get("x-request-id") for r in refused]
        assert all(i and i.startswith("req_") for i in ids) and len(set(ids)) == len(ids), ids
        assert all("x-shoal-worker" not in r.headers for r in refused)  # no worker was asked
