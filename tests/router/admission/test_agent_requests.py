"""agent_requests.py and requests.check_body for the Responses and Messages APIs."""

from __future__ import annotations

from typing import Any

import pytest

from shoal.protocol.messages import Endpoint
from shoal.router.admission.requests import RequestLimits, check_body
from shoal.router.dispatch.need import NO_NEED, Need, need_of
from shoal.router.errors import BadRequest

USER = [{"role": "user", "content": "hi"}]


def check(endpoint: Endpoint, body: dict[str, Any], max_tokens: int | None = None) -> Any:
    return check_body(endpoint, body, "m", RequestLimits(max_tokens=max_tokens))


def test_each_api_names_its_token_limit_in_its_own_field() -> None:
    assert check(Endpoint.RESPONSES, {"input": "hi"}, 64).body["max_output_tokens"] == 64
    assert check(Endpoint.MESSAGES, {"messages": USER}, 64).body["max_tokens"] == 64
    assert "max_tokens" not in check(Endpoint.COUNT_TOKENS, {"messages": USER}, 64).body
    body = {"input": "hi", "max_output_tokens": 10}
    assert check(Endpoint.RESPONSES, body, 64).body is body


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (Endpoint.RESPONSES, {}, "input"),
        (Endpoint.MESSAGES, {"max_tokens": 5}, "messages"),
        (Endpoint.MESSAGES, {"messages": []}, "messages"),
        (Endpoint.MESSAGES, {"messages": [{"content": "no role"}]}, "messages"),
        (Endpoint.COUNT_TOKENS, {"messages": USER, "stream": True}, "stream"),
        (Endpoint.RESPONSES, {"input": "hi", "max_output_tokens": 65}, "max_output_tokens"),
        (Endpoint.MESSAGES, {"messages": USER, "max_tokens": 0}, "max_tokens"),
        (
            Endpoint.RESPONSES,
            {"input": "hi", "previous_response_id": 7},
            "previous_response_id",
        ),
    ],
)
def test_refusals_name_the_field(endpoint: Endpoint, body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        check(endpoint, body, 64)
    assert refused.value.param == param


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_anthropic_structured_output_is_refused_with_what_works(field: str) -> None:
    schema = {"type": "json_schema", "schema": {"type": "object"}}
    value = {"format": schema} if field == "output_config" else schema
    with pytest.raises(BadRequest) as refused:
        check(Endpoint.MESSAGES, {"messages": USER, field: value})
    assert refused.value.param == field
    assert "input_schema" in refused.value.message and "tool_choice" in refused.value.message
    effort_only = {"messages": USER, "output_config": {"effort": "low"}}
    assert check(Endpoint.MESSAGES, effort_only).body == effort_only


def test_the_context_a_responses_or_messages_request_needs() -> None:
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    responses = {"input": "hello", "instructions": "be brief", "max_output_tokens": 7}
    assert need_of(Endpoint.RESPONSES, responses) == Need(5 + 8, 0, 7, "max_output_tokens")
    with_tools = need_of(Endpoint.RESPONSES, {**responses, "tools": tools})
    assert with_tools.text_bytes == 13 + len("function") + len("f") + len("object")
    image = {"type": "image", "source": {"type": "base64", "data": "A" * 4000}}
    messages = {
        "system": "sys",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}],
        "max_tokens": 3,
    }
    assert need_of(Endpoint.MESSAGES, messages) == Need(3 + 4 + 4 + 2 + 5, 0, 3, "max_tokens")
    assert need_of(Endpoint.COUNT_TOKENS, messages) is NO_NEED
