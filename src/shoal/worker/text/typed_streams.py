"""The Responses and Messages APIs as a worker carries them to its llama-server (pure).

llama-server serves ``/v1/responses``, ``/v1/messages`` and ``/v1/messages/count_tokens``
itself (it converts each request to a chat completion and its answer back), so the worker
sends the client's body as it is, with two exceptions that the pinned llama-server needs:

- a Responses request's structured output (``text.format``, the Responses API's place for
  it) is also given as ``response_format``, the only place llama-server reads a JSON schema
  from (its converter copies every other field of the request into the chat completion);
- the slot (``id_slot``) the worker pins a Responses job to; a Messages request cannot be
  pinned (llama-server's Anthropic converter keeps only the fields it knows).

Their streams are typed events (``event: NAME`` and ``data: {"type": NAME, ...}``) with no
``data: [DONE]``: a stream is complete at its last event (``response.completed`` or
``message_stop``), and a connection that closes before it was cut short. A failure after the
first event arrives as ``data: {"error": {...}}`` (Responses) or ``event: error`` with the bare
error object (Messages); ``stream_end`` tells these apart from output.
"""

from __future__ import annotations

import enum
from typing import Any

import orjson

from shoal.protocol.messages import Endpoint

LAST_EVENTS = frozenset(
    {"response.completed", "response.failed", "response.incomplete", "message_stop"}
)
"""The event types that end a stream of the Responses or Messages API."""


class StreamEnd(enum.Enum):
    DONE = "done"
    ERROR = "error"


def backend_body(endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as llama-server needs it for ``endpoint`` (a copy when changed)."""
    if endpoint is not Endpoint.RESPONSES or "response_format" in body:
        return body
    text = body.get("text")
    form = text.get("format") if isinstance(text, dict) else None
    if not isinstance(form, dict) or form.get("type") not in ("json_schema", "json_object"):
        return body
    if form["type"] == "json_object":
        return {**body, "response_format": {"type": "json_object"}}
    schema = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
    return {**body, "response_format": {"type": "json_schema", "json_schema": schema}}


def stream_end(data: str) -> StreamEnd | None:
    """Whether the event ``data`` ends a typed stream: its last event, or an error."""
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(event, dict):
        return None
    if "error" in event or (isinstance(event.get("code"), int) and "message" in event):
        return StreamEnd.ERROR
    return StreamEnd.DONE if event.get("type") in LAST_EVENTS else None


def error_payload(data: str) -> bytes:
    """An error event's data as llama-server's error answers are: ``{"error": {...}}``."""
    event = orjson.loads(data)
    return data.encode() if "error" in event else orjson.dumps({"error": event})
