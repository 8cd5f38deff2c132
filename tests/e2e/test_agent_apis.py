"""OpenAI's Responses API and Anthropic's Messages API through a real router and a real worker
running llama-server, with the official ``openai`` and ``anthropic`` SDKs.

The worker's llama-server renders prompts with a chat template that has tools (Qwen2.5's; the
default model's own has none, so llama-server would parse no tool call), and a tool call is
asked for with the assistant's turn begun with the call's opening tag, which llama-server
continues (``tool_choice`` alone does not make the default model call: the grammar admits
text before the call).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

import http_calls
from cluster import API_KEY, MODEL, Cluster, Router

pytestmark = pytest.mark.e2e

TOOL_TEMPLATE = Path(__file__).parents[1] / "worker/text/resume/data/qwen2.5-tools.jinja"
HELLO = "Say hello in one word."
WEATHER_QUESTION = "What is the weather in Paris for the next 3 days?"
CALL_OPENING = "<tool_call>\n"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}


@dataclass
class Shared:
    router: Router
    openai: openai.OpenAI
    anthropic: anthropic.Anthropic


Clients = Callable[..., tuple[openai.OpenAI, anthropic.Anthropic]]


def _pair(router: Router, key: str = API_KEY) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (
        openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=60),
        anthropic.Anthropic(base_url=router.url, api_key=key, max_retries=0, timeout=60),
    )


@pytest.fixture
def clients() -> Iterator[Clients]:
    """Both SDKs' clients of a router (``clients(router, key=...)``), closed after the test."""
    opened: list[openai.OpenAI | anthropic.Anthropic] = []

    def make(router: Router, key: str = API_KEY) -> tuple[openai.OpenAI, anthropic.Anthropic]:
        pair = _pair(router, key)
        opened.extend(pair)
        return pair

    yield make
    for client in opened:
        client.close()


@pytest.fixture(scope="module")
def shared(session_cluster: Cluster) -> Iterator[Shared]:
    router = session_cluster.router()
    session_cluster.worker(
        router,
        *("--slots", "2", "--ctx-size", "2048"),
        *("--llama-server-args", f"--chat-template-file {TOOL_TEMPLATE}"),
        name="agents",
    )
    router.wait_workers(1)
    oai, claude = _pair(router)
    yield Shared(router, oai, claude)
    oai.close()
    claude.close()


# ---------------------------------------------------------------- Responses API


def test_responses_not_streamed_and_streamed(shared: Shared) -> None:
    asked: dict[str, Any] = {"model": MODEL, "input": HELLO, "max_output_tokens": 8}
    whole = shared.openai.responses.create(**asked, temperature=0)
    assert (whole.object, whole.status, whole.model) == ("response", "completed", MODEL)
    assert whole.output_text
    assert whole.usage is not None and whole.usage.input_tokens > 0
    assert whole.usage.output_tokens > 0

    events = list(shared.openai.responses.create(**asked, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    last = events[-1]
    assert last.type == "response.completed" and last.response.usage is not None
    assert last.response.usage.output_tokens == whole.usage.output_tokens


def _weather_input() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": WEATHER_QUESTION},
        {"role": "assistant", "type": "message", "content": CALL_OPENING},
    ]


RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}


def test_responses_tool_call_not_streamed_and_streamed(shared: Shared) -> None:
    asked: dict[str, Any] = {
        "model": MODEL,
        "input": _weather_input(),
        "tools": [RESPONSES_TOOL],
        "tool_choice": "required",
        "temperature": 0,
        "max_output_tokens": 40,
    }
    whole = shared.openai.responses.create(**asked)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather", whole.output
    assert "city" in json.loads(calls[0].arguments)

    events = list(shared.openai.responses.create(**asked, stream=True))
    streamed = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    last = events[-1]
    assert last.type == "response.completed"
    done = [item for item in last.response.output if item.type == "function_call"]
    assert done and done[0].name == "get_weather"
    assert json.loads(streamed) == json.loads(done[0].arguments) == json.loads(calls[0].arguments)


def test_responses_structured_output(shared: Shared) -> None:
    schema = {
        "type": "object",
        "properties": {"greeting": {"type": "string", "maxLength": 20}},
        "required": ["greeting"],
        "additionalProperties": False,
    }
    answer = shared.openai.responses.create(
        model=MODEL,
        input="Greet me.",
        text={"format": {"type": "json_schema", "name": "hello", "schema": schema}},
        max_output_tokens=60,
        temperature=0,
    )
    assert set(json.loads(answer.output_text)) == {"greeting"}


def test_responses_errors(shared: Shared) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        shared.openai.responses.create(model="no-such-model", input=HELLO)
    assert "no-such-model" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as ungrammatical:
        shared.openai.responses.create(
            model=MODEL,
            input=HELLO,
            text={"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}},
        )
    assert "$ref" in ungrammatical.value.message  # llama-server's words for the problem


BAD_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
"""A JSON schema llama-server cannot make a grammar of (a reference to nothing)."""


# ---------------------------------------------------------------- Messages API

GREEDY = {"temperature": 0}
"""The anthropic SDK (2.x) no longer takes ``temperature`` itself; llama-server reads it."""


def test_messages_not_streamed_and_streamed(shared: Shared) -> None:
    asked: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 8,
        "extra_body": GREEDY,
        "messages": [{"role": "user", "content": HELLO}],
    }
    whole = shared.anthropic.messages.create(**asked)
    assert (whole.type, whole.role, whole.model) == ("message", "assistant", MODEL)
    assert whole.content[0].type == "text" and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0

    with shared.anthropic.messages.stream(**asked) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_messages_tool_use_not_streamed_and_streamed(shared: Shared) -> None:
    asked: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 80,
        "extra_body": GREEDY,
        "stop_sequences": ["</tool_call>"],  # the default model would go on with another call
        "messages": [
            {"role": "user", "content": WEATHER_QUESTION},
            {"role": "assistant", "content": CALL_OPENING},
        ],
        "tools": [
            {"name": "get_weather", "description": "The forecast.", "input_schema": WEATHER_SCHEMA}
        ],
        "tool_choice": {"type": "any"},
    }
    whole = shared.anthropic.messages.create(**asked)
    uses = [block for block in whole.content if block.type == "tool_use"]
    assert uses and uses[0].name == "get_weather", whole.content
    assert whole.stop_reason == "tool_use"
    assert isinstance(uses[0].input, dict) and "city" in uses[0].input

    with shared.anthropic.messages.stream(**asked) as stream:
        final = stream.get_final_message()
    streamed = [block for block in final.content if block.type == "tool_use"]
    assert final.stop_reason == "tool_use"  # what translating proxies drop
    assert streamed and streamed[0].input == uses[0].input  # the streamed input, assembled


def test_count_tokens(shared: Shared) -> None:
    def count(text: str) -> int:
        counted = shared.anthropic.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": text}]
        )
        return counted.input_tokens

    short, longer = count("hi"), count("hi " * 40)
    assert 0 < short < longer


def test_messages_errors_are_anthropics(shared: Shared, clients: Clients) -> None:
    _, wrong = clients(shared.router, key="sk-wrong")
    hello = [{"role": "user", "content": HELLO}]
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=MODEL, max_tokens=8, messages=hello)
    assert refused.value.status_code == 401
    assert refused.value.body == {
        "type": "error",
        "error": {
            "type": "authentication_error",
            "message": refused.value.body["error"]["message"],
        },
    }
    with pytest.raises(anthropic.NotFoundError) as unknown:
        shared.anthropic.messages.create(model="no-such-model", max_tokens=8, messages=hello)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as structured:
        shared.anthropic.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=hello,
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": {}}}},
        )
    assert structured.value.body["error"]["type"] == "invalid_request_error"
    # a bearer key works as well as x-api-key, and the bare HTTP answer is Anthropic's too
    answer = http_calls.post(
        shared.router.url + "/v1/messages",
        headers={"Authorization": "Bearer sk-wrong"},
        json={"model": MODEL, "max_tokens": 8, "messages": hello},
    )
    assert answer.status_code == 401 and answer.json()["type"] == "error"


# ---------------------------------------------------------------- a worker killed mid-answer

LONG = [{"role": "user", "content": "Count from 1 to 300, one number per line."}]


def test_a_killed_worker_ends_both_streams_with_their_error_events(
    cluster: Cluster, clients: Clients
) -> None:
    router = cluster.router()
    worker = cluster.worker(router, "--slots", "2", "--ctx-size", "2048", name="doomed")
    router.wait_workers(1)
    oai, claude = clients(router)
    # the Responses answer first, which cannot end early (llama-server's Responses converter
    # keeps ignore_eos; its Anthropic one drops it), then the Messages one: both mid-answer
    responses = iter(
        oai.responses.create(
            model=MODEL,
            input=LONG,
            max_output_tokens=600,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    next(e for e in responses if e.type == "response.output_text.delta")
    with claude.messages.stream(
        model=MODEL, max_tokens=600, extra_body=GREEDY, messages=LONG
    ) as messages:
        claude_events = iter(messages)
        next(e for e in claude_events if e.type == "content_block_delta")
        worker.signal(signal.SIGKILL)
        with pytest.raises(anthropic.APIStatusError) as cut:
            for _ in claude_events:
                pass
    assert cut.value.body["error"]["type"] == "api_error"
    assert "worker" in cut.value.body["error"]["message"]
    rest = list(responses)
    kinds = [event.type for event in rest]
    assert kinds[-2:] == ["error", "response.failed"], kinds
    assert rest[-2].code == "worker_lost"
    assert rest[-1].response.status == "failed"


# ---------------------------------------------------------------- stored responses, two routers

REDIS_URL = "redis://127.0.0.1:6379/0"


def test_previous_response_id_across_two_routers_sharing_redis(
    cluster: Cluster, redis_prefix: str, clients: Clients
) -> None:
    """A response stored through one router is continued, read and deleted through another;
    the follow-up carries the whole conversation, to the worker whose slot holds it."""
    shared = ("--redis-url", REDIS_URL, "--redis-prefix", redis_prefix)
    first, second = cluster.router(*shared), cluster.router(*shared)
    cluster.worker(first, "--slots", "2", "--ctx-size", "2048", name="holder")
    first.wait_workers(1)
    one, _ = clients(first)
    two, _ = clients(second)
    story = "My cat is called Whiskers and she sleeps on the piano every afternoon. " * 4
    stored = one.responses.create(
        model=MODEL, input=story + "Say OK.", store=True, max_output_tokens=8, temperature=0
    )
    follow = two.responses.create(
        model=MODEL,
        previous_response_id=stored.id,
        input="What is my cat called?",
        max_output_tokens=8,
        temperature=0,
        stream=True,
    )
    last = list(follow)[-1]
    assert last.type == "response.completed" and last.response.usage is not None
    alone = two.responses.create(model=MODEL, input="What is my cat called?", max_output_tokens=8)
    assert stored.usage is not None and alone.usage is not None
    usage = last.response.usage
    # the whole conversation went (the first input and output, then the question), and the
    # worker had its start cached
    assert usage.input_tokens > stored.usage.input_tokens + stored.usage.output_tokens
    assert usage.input_tokens > alone.usage.input_tokens + stored.usage.input_tokens // 2
    assert usage.input_tokens_details.cached_tokens >= stored.usage.input_tokens - 10

    assert two.responses.retrieve(stored.id).output_text == stored.output_text
    two.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        one.responses.create(model=MODEL, previous_response_id=stored.id, input="Again?")
    with pytest.raises(openai.NotFoundError):
        one.responses.retrieve(stored.id)
