"""typed_streams.py: the end of a Responses or Messages stream, and the body llama-server gets."""

from __future__ import annotations

import orjson
import pytest

from shoal.protocol.messages import Endpoint
from shoal.worker.text.backend_errors import error_from_body
from shoal.worker.text.typed_streams import StreamEnd, backend_body, error_payload, stream_end


@pytest.mark.parametrize(
    ("data", "end"),
    [
        ('{"type":"message_start","message":{"id":"x"}}', None),
        ('{"delta":"hi","item_id":"m","type":"response.output_text.delta"}', None),
        ('{"type":"message_stop"}', StreamEnd.DONE),
        ('{"response":{"status":"completed"},"type":"response.completed"}', StreamEnd.DONE),
        ('{"error":{"code":500,"message":"boom","type":"server_error"}}', StreamEnd.ERROR),
        ('{"code":500,"message":"boom","type":"server_error"}', StreamEnd.ERROR),
        ("not json", None),
    ],
)
def test_stream_end(data: str, end: StreamEnd | None) -> None:
    assert stream_end(data) is end


def test_both_error_events_read_as_an_error_body() -> None:
    for data in (
        '{"error":{"code":500,"message":"boom","type":"server_error"}}',
        '{"code":500,"message":"boom","type":"server_error"}',
    ):
        error = error_from_body(500, error_payload(data))
        assert (error.message, error.type, error.code) == ("boom", "server_error", 500)


def test_responses_text_format_also_becomes_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    form = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    body = {"input": "hi", "text": {"format": form}}
    sent = backend_body(Endpoint.RESPONSES, body)
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": True},
    }
    assert sent["text"] == body["text"] and "response_format" not in body
    json_object = {"input": "hi", "text": {"format": {"type": "json_object"}}}
    assert backend_body(Endpoint.RESPONSES, json_object)["response_format"] == {
        "type": "json_object"
    }


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (Endpoint.RESPONSES, {"input": "hi"}),
        (Endpoint.RESPONSES, {"input": "hi", "text": {"format": {"type": "text"}}}),
        (
            Endpoint.RESPONSES,
            {
                "input": "hi",
                "response_format": {"type": "json_object"},
                "text": {"format": {"type": "json_schema", "schema": {}}},
            },
        ),
        (Endpoint.MESSAGES, {"messages": [], "text": {"format": {"type": "json_object"}}}),
    ],
)
def test_other_bodies_go_as_they_are(endpoint: Endpoint, body: dict[str, object]) -> None:
    assert backend_body(endpoint, body) is body


def test_error_payload_keeps_an_error_answer_as_it_is() -> None:
    data = '{"error":{"message":"x"}}'
    assert orjson.loads(error_payload(data)) == {"error": {"message": "x"}}
