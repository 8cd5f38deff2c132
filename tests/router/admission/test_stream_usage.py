"""The usage a streaming client did not ask for is taken out of its stream
(``router/admission/usage.py`` ``for_client``), while the router still reads the tokens to charge
from what the worker sent.
(Through real processes, with an attached server that is not llama.cpp:
``tests/e2e/test_backends.py``.)"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.protocol.messages import Endpoint
from shoal.router.admission.usage import asks_usage, for_client, tokens_of

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
CONTENT = {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}


def dumps(obj: dict[str, Any]) -> str:
    return orjson.dumps(obj).decode()


@pytest.mark.parametrize(
    ("chunk", "expected"),
    [
        (CONTENT, CONTENT),  # most chunks: untouched
        ({"id": "c", "choices": [], "usage": USAGE}, None),  # vLLM's, OpenAI's last chunk
        ({**CONTENT, "usage": USAGE}, CONTENT),  # continuous usage, llama-server's completions
        ({**CONTENT, "usage": None}, CONTENT),  # OpenAI's chunks when usage was asked for
        ({"id": "c", "choices": [], "usage": None}, None),
        (
            {"choices": [{"delta": {"content": '"usage": {}'}}]},  # in a string: not a key
            {"choices": [{"delta": {"content": '"usage": {}'}}]},
        ),
        ({"choices": [{"usage": 1}]}, {"choices": [{"usage": 1}]}),  # deeper down: kept
    ],
)
def test_for_client(chunk: dict[str, Any], expected: dict[str, Any] | None) -> None:
    out = for_client(dumps(chunk))
    assert (None if out is None else orjson.loads(out)) == expected


def test_chunks_that_are_not_json_objects_pass_as_they_are() -> None:
    assert for_client('"usage"') == '"usage"'
    assert for_client('{"usage": bad') == '{"usage": bad'


@given(
    st.dictionaries(st.sampled_from(["id", "model", "timings", "created"]), st.integers(0, 2**40)),
    st.lists(st.dictionaries(st.sampled_from(["index", "text"]), st.integers(0, 9)), max_size=2),
    st.none() | st.just(USAGE),
)
def test_a_chunk_loses_its_usage_and_nothing_else(
    fields: dict[str, int], choices: list[dict[str, int]], usage: dict[str, int] | None
) -> None:
    chunk: dict[str, Any] = {**fields, "choices": choices, "usage": usage}
    out = for_client(dumps(chunk))
    if not choices:
        assert out is None
        return
    assert out is not None
    assert orjson.loads(out) == {**fields, "choices": choices}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, False),
        ({"stream_options": None}, False),
        ({"stream_options": {}}, False),
        ({"stream_options": {"include_usage": False}}, False),
        ({"stream_options": {"include_usage": "yes"}}, False),  # not a boolean: not asked
        ({"stream_options": {"include_usage": True}}, True),
    ],
)
def test_asks_usage(body: dict[str, Any], expected: bool) -> None:
    assert asks_usage(body) is expected


def test_the_dropped_chunk_is_what_the_tokens_are_read_from() -> None:
    last = dumps({"id": "c", "choices": [], "usage": USAGE})
    assert for_client(last) is None and tokens_of(last) == (7, 3)


def test_only_chat_and_completions_streams_report_usage() -> None:
    assert {e for e in Endpoint if e.streams_usage} == {Endpoint.CHAT, Endpoint.COMPLETIONS}
