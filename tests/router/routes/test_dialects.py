"""dialects.py: each API's framing of events and errors, and where it finds an answer's tokens."""

from __future__ import annotations

import orjson
import pytest

from shoal.api_errors import ApiError
from shoal.protocol.messages import Endpoint, ErrorBody
from shoal.router.errors import (
    BadRequest,
    ModelNotFound,
    PayloadTooLarge,
    RateLimitExceeded,
    Unauthorized,
    Unavailable,
    UpstreamError,
    WorkerLost,
)
from shoal.router.routes.dialects import Dialect, Messages, Responses, anthropic_error, dialect_of


def _events(raw: bytes) -> list[tuple[str | None, dict[str, object]]]:
    """(event name, data) of each SSE event in ``raw``."""
    out: list[tuple[str | None, dict[str, object]]] = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((fields.get("event"), orjson.loads(fields["data"])))
    return out


def test_openai_framing_is_data_lines_and_done() -> None:
    dialect = dialect_of(Endpoint.CHAT)
    assert type(dialect) is Dialect
    assert dialect.event('{"a":1}') == b'data: {"a":1}\n\n'
    assert dialect.done == b"data: [DONE]\n\n"
    assert _events(dialect.error_event(BadRequest("no")))[0] == (
        None,
        {"error": {"message": "no", "type": "invalid_request_error", "param": None, "code": None}},
    )


def test_typed_events_are_named_by_their_type() -> None:
    for endpoint in (Endpoint.RESPONSES, Endpoint.MESSAGES):
        dialect = dialect_of(endpoint)
        data = '{"type":"content_block_start","content_block":{"type":"text"}}'
        assert (
            dialect.event(data) == b"event: content_block_start\ndata: " + data.encode() + b"\n\n"
        )
        assert dialect.done == b""
        assert not dialect.caches_streams


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (BadRequest("x"), 400, "invalid_request_error"),
        (Unauthorized("x"), 401, "authentication_error"),
        (ModelNotFound("x"), 404, "not_found_error"),
        (PayloadTooLarge("x"), 413, "request_too_large"),
        (RateLimitExceeded("x"), 429, "rate_limit_error"),
        (Unavailable("x"), 529, "overloaded_error"),
        (WorkerLost("x"), 500, "api_error"),
        (UpstreamError(422, ErrorBody(message="x", type="t")), 400, "invalid_request_error"),
    ],
)
def test_anthropic_errors_have_anthropics_shape_and_status(
    error: ApiError, status: int, kind: str
) -> None:
    response = Messages().error_response(error)
    assert response.status_code == status
    assert orjson.loads(response.body) == {
        "type": "error",
        "error": {"type": kind, "message": "x"},
    }


def test_anthropic_error_keeps_retry_after() -> None:
    response = Messages().error_response(Unavailable("busy", retry_after=2.5))
    assert response.headers["retry-after"] == "3"
    assert anthropic_error(504) == (504, "timeout_error")


def test_anthropic_stream_error_is_an_error_event() -> None:
    raw = Messages().error_event(WorkerLost("the worker was lost"))
    assert _events(raw) == [
        (
            "error",
            {"type": "error", "error": {"type": "api_error", "message": "the worker was lost"}},
        )
    ]


def test_responses_stream_error_is_error_then_response_failed() -> None:
    dialect = Responses()
    dialect.event('{"type":"response.created","response":{"id":"resp_1","status":"in_progress"}}')
    raw = dialect.error_event(WorkerLost("lost"))
    (name1, error), (name2, failed) = _events(raw)
    assert (name1, error["type"], error["code"], error["message"]) == (
        "error",
        "error",
        "worker_lost",
        "lost",
    )
    assert name2 == failed["type"] == "response.failed"
    assert failed["response"] == {
        "id": "resp_1",
        "object": "response",
        "status": "failed",
        "error": {"code": "worker_lost", "message": "lost"},
    }
    assert error["sequence_number"] == 1 and failed["sequence_number"] == 2


def test_responses_errors_before_the_stream_are_openai_json() -> None:
    response = Responses().error_response(BadRequest("bad", param="input"))
    assert response.status_code == 400
    assert orjson.loads(response.body)["error"]["param"] == "input"


def test_responses_tokens_from_a_body_and_from_response_completed() -> None:
    usage = {"input_tokens": 12, "output_tokens": 5, "input_tokens_details": {"cached_tokens": 8}}
    body = orjson.dumps({"object": "response", "usage": usage}).decode()
    event = orjson.dumps({"type": "response.completed", "response": {"usage": usage}}).decode()
    for answer in (body, event):
        assert Responses().tokens(answer) == (12, 5)
        assert Responses().cached(answer) == 8


def test_messages_tokens_from_a_body() -> None:
    usage = {"input_tokens": 4, "cache_read_input_tokens": 6, "output_tokens": 3}
    body = orjson.dumps({"type": "message", "usage": usage}).decode()
    assert Messages().tokens(body) == (10, 3)
    assert Messages().cached(body) == 6


def test_messages_stream_tokens_from_its_start_and_delta() -> None:
    dialect = Messages()
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 7, "output_tokens": 0}}}
    dialect.event(orjson.dumps(start).decode())
    dialect.event('{"type":"content_block_delta","delta":{"type":"text_delta","text":"hi"}}')
    dialect.event(
        '{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":9}}'
    )
    dialect.event('{"type":"message_stop"}')
    assert dialect.tokens('{"type":"message_stop"}') == (7, 9)


def test_a_token_count_costs_no_tokens() -> None:
    assert dialect_of(Endpoint.COUNT_TOKENS).tokens('{"input_tokens":55}') == (0, 0)
