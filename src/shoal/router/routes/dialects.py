"""How each API a job can come from frames its answer and its errors: OpenAI's chat,
completions and embeddings (the default), OpenAI's Responses API and Anthropic's Messages API.

A worker sends each streamed event's ``data`` as llama-server wrote it; the ``Dialect`` of the
job's endpoint writes it to the client (``data:`` lines ending in ``[DONE]``, or the typed
events ``event: NAME`` + ``data:`` of the newer APIs), shapes every error the client gets as
its API documents errors (an Anthropic client gets ``{"type": "error", "error": {...}}`` with
Anthropic's statuses; a Responses stream gets an ``error`` event and ``response.failed``),
and reads the tokens an answer used from where its API puts them. One instance serves one
response (it follows the stream's events); ``dialect_of`` makes it. Pure but for that state.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from shoal.api_errors import ApiError, error_payload, error_response
from shoal.protocol.messages import Endpoint
from shoal.router.admission.usage import cached_of, tokens_of


class Dialect:
    """OpenAI's chat completions, completions and embeddings."""

    done = b"data: [DONE]\n\n"
    """What ends a stream that succeeded, after its last event."""
    caches_streams = True
    """A streamed answer may be kept in the result cache and replayed (as ``data:`` events)."""

    def event(self, data: str) -> bytes:
        """One streamed event as the client gets it."""
        return b"data: " + data.encode() + b"\n\n"

    def error_event(self, exc: ApiError) -> bytes:
        """An error as the last event of a stream that has started."""
        return b"data: " + orjson.dumps(error_payload(exc)) + b"\n\n"

    def error_response(self, exc: ApiError) -> Response:
        """An error instead of an answer (before any of it was sent)."""
        return error_response(exc)

    def tokens(self, answer: str) -> tuple[int, int] | None:
        """``(tokens in, tokens out)`` of an answer: its body, or its stream's last event."""
        return tokens_of(answer)

    def cached(self, answer: str) -> int | None:
        """Prompt tokens the answer reused from llama-server's cache."""
        return cached_of(answer)


class _Typed(Dialect):
    """An API whose streams are typed events (``event: TYPE``, ``data: {"type": TYPE}``)
    that end with an event of their own, not ``[DONE]``."""

    done = b""
    caches_streams = False

    def event(self, data: str) -> bytes:
        name = _type_of(data)
        self.observe(name, data)
        head = b"event: " + name.encode() + b"\n" if name else b""
        return head + b"data: " + data.encode() + b"\n\n"

    def observe(self, name: str, data: str) -> None:
        """What a stream's event says about its usage (the typed APIs spread it)."""


class Responses(_Typed):
    """OpenAI's Responses API (``/v1/responses``): non-streamed errors are OpenAI's JSON;
    a stream that fails gets an ``error`` event and then ``response.failed``."""

    def __init__(self) -> None:
        self.response_id: str | None = None
        self.events = 0

    def observe(self, name: str, data: str) -> None:
        self.events += 1
        if name == "response.created":
            response = _loads(data).get("response")
            if isinstance(response, dict) and isinstance(response.get("id"), str):
                self.response_id = response["id"]

    def error_event(self, exc: ApiError) -> bytes:
        error: dict[str, object] = {
            "type": "error",
            "code": _code(exc),
            "message": exc.message,
            "param": exc.param,
        }
        failed: dict[str, object] = {
            "type": "response.failed",
            "response": {
                "id": self.response_id,
                "object": "response",
                "status": "failed",
                "error": {"code": _code(exc), "message": exc.message},
            },
        }
        out = b""
        for event in (error, failed):
            event["sequence_number"] = self.events
            self.events += 1
            out += b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event)
            out += b"\n\n"
        return out

    def tokens(self, answer: str) -> tuple[int, int] | None:
        usage = _usage(answer)
        if usage is None:
            return tokens_of(answer)  # llama-server's timings, if any
        return _int(usage.get("input_tokens")), _int(usage.get("output_tokens"))

    def cached(self, answer: str) -> int | None:
        usage = _usage(answer)
        details = usage.get("input_tokens_details") if usage else None
        return _int(details.get("cached_tokens")) if isinstance(details, dict) else None


ANTHROPIC_ERRORS: dict[int, tuple[int, str]] = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    413: (413, "request_too_large"),
    429: (429, "rate_limit_error"),
    503: (529, "overloaded_error"),
    504: (504, "timeout_error"),
}
"""Shoal's status → Anthropic's status and error type, as Anthropic documents its errors
(every other 4xx is an ``invalid_request_error``, every other 5xx a 500 ``api_error``)."""


def anthropic_error(status: int) -> tuple[int, str]:
    """The status and ``error.type`` an Anthropic client gets for Shoal's ``status``."""
    if status in ANTHROPIC_ERRORS:
        return ANTHROPIC_ERRORS[status]
    return (400, "invalid_request_error") if status < 500 else (500, "api_error")


def anthropic_payload(exc: ApiError) -> dict[str, Any]:
    """``exc`` as Anthropic's error JSON."""
    kind = anthropic_error(exc.status)[1]
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


class Messages(_Typed):
    """Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``): errors in
    Anthropic's JSON and statuses; usage from ``message_start`` and ``message_delta``."""

    def __init__(self, count: bool = False) -> None:
        self.count = count
        self.usage: dict[str, int] = {}

    def observe(self, name: str, data: str) -> None:
        if name == "message_start":
            message = _loads(data).get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            self.usage.update(_counts(usage))
        elif name == "message_delta":
            self.usage.update(_counts(_loads(data).get("usage")))

    def error_event(self, exc: ApiError) -> bytes:
        return b"event: error\ndata: " + orjson.dumps(anthropic_payload(exc)) + b"\n\n"

    def error_response(self, exc: ApiError) -> Response:
        return Response(
            orjson.dumps(anthropic_payload(exc)),
            status_code=anthropic_error(exc.status)[0],
            media_type="application/json",
            headers=exc.headers,
        )

    def tokens(self, answer: str) -> tuple[int, int] | None:
        if self.count:
            return (0, 0)  # a count generates nothing and holds no slot's context
        usage = self.usage or _counts(_usage(answer))
        if "input_tokens" not in usage and "output_tokens" not in usage:
            return None
        prompt = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
        return prompt, usage.get("output_tokens", 0)

    def cached(self, answer: str) -> int | None:
        usage = self.usage or _counts(_usage(answer))
        return usage.get("cache_read_input_tokens")


def dialect_of(endpoint: Endpoint) -> Dialect:
    """A new ``Dialect`` for one response to a request to ``endpoint``."""
    if endpoint is Endpoint.RESPONSES:
        return Responses()
    if endpoint in (Endpoint.MESSAGES, Endpoint.COUNT_TOKENS):
        return Messages(count=endpoint is Endpoint.COUNT_TOKENS)
    return Dialect()


def _loads(data: str) -> dict[str, Any]:
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _type_of(data: str) -> str:
    name = _loads(data).get("type")
    return name if isinstance(name, str) and name.isprintable() and "\n" not in name else ""


def _usage(answer: str) -> dict[str, Any] | None:
    """The ``usage`` of a whole answer, or of a stream's ``response.completed`` event."""
    body = _loads(answer)
    response = body.get("response")
    usage = (response if isinstance(response, dict) else body).get("usage")
    return usage if isinstance(usage, dict) else None


def _counts(usage: object) -> dict[str, int]:
    if not isinstance(usage, dict):
        return {}
    return {k: v for k, v in usage.items() if isinstance(v, int) and not isinstance(v, bool)}


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _code(exc: ApiError) -> str | None:
    """An error's ``code`` as a Responses error event carries it (a string)."""
    return None if exc.code is None else str(exc.code)
