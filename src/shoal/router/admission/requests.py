"""What a request to the inference routes may be: read within the size limit, then checked.

The body is read only up to ``--max-body-bytes`` (413 past it, without reading the rest), then
``check_body`` (pure) refuses with a 400 that names the field what cannot work (messages or
tools so malformed that llama-server would answer 500), and what this router does not allow
(more than ``--max-messages`` messages, more than ``--max-tokens-limit`` tokens).
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from dataclasses import dataclass
from typing import Any, TypeGuard

import orjson
from starlette.datastructures import Headers

from shoal.protocol.messages import AGENT_ENDPOINTS, Endpoint
from shoal.router.admission.agent_requests import check_agent_body
from shoal.router.admission.token_limit import check_token_count
from shoal.router.errors import BadRequest, PayloadTooLarge
from shoal.router.settings import RouterSettings

REQUIRED_FIELD = {
    Endpoint.CHAT: "messages",
    Endpoint.COMPLETIONS: "prompt",
    Endpoint.EMBEDDINGS: "input",
    Endpoint.RESPONSES: "input",
    Endpoint.MESSAGES: "messages",
    Endpoint.COUNT_TOKENS: "messages",
}
_MESSAGE_LISTS = frozenset({Endpoint.CHAT, Endpoint.MESSAGES, Endpoint.COUNT_TOKENS})
_NOT_STREAMED = {
    Endpoint.EMBEDDINGS: "Embeddings cannot be streamed.",
    Endpoint.COUNT_TOKENS: "A token count cannot be streamed.",
}
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
"""The OpenAI names for the most tokens to generate."""
NATIVE_TOKEN_FIELD = "n_predict"
"""llama-server's own name for it, which it also reads on the OpenAI routes."""
MAX_CHOICES = 16
"""Most choices (``n``) one request may ask for; llama-server also caps it at its slots."""


@dataclass(frozen=True)
class RequestLimits:
    """What this router accepts in one inference request (from its settings)."""

    max_body_bytes: int = 8 * 1024 * 1024
    max_messages: int = 1024
    max_tokens: int | None = None

    @classmethod
    def of(cls, settings: RouterSettings) -> RequestLimits:
        return cls(settings.max_body_bytes, settings.max_messages, settings.max_tokens_limit)


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed ``check_body``: what to queue, and the body to forward."""

    model: str
    stream: bool
    body: dict[str, Any]


def json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(
            f"The request body is not valid JSON ({exc.msg} at position {exc.pos}). "
            "Send a JSON object with Content-Type: application/json."
        ) from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def check_body(
    endpoint: Endpoint, body: dict[str, Any], default_model: str, limits: RequestLimits
) -> CheckedRequest:
    """Refuse (400) what cannot work or is over ``limits``; else what to queue and forward.

    With a token limit, a request that names no limit is forwarded with ``max_tokens`` set to
    it, so no request generates more than the router allows.
    """
    model = body.get("model", default_model)
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string.", param="model")
    required = REQUIRED_FIELD[endpoint]
    if required not in body:
        raise BadRequest(f"'{required}' is required for {endpoint.path}.", param=required)
    if endpoint in _MESSAGE_LISTS:
        _check_messages(body["messages"], limits.max_messages)
    if endpoint is Endpoint.CHAT:
        _check_tools(body.get("tools"))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false.", param="stream")
    if stream and endpoint in _NOT_STREAMED:
        raise BadRequest(_NOT_STREAMED[endpoint], param="stream")
    if endpoint in AGENT_ENDPOINTS:
        return CheckedRequest(model, stream, check_agent_body(endpoint, body, limits.max_tokens))
    if endpoint is Endpoint.EMBEDDINGS:
        return CheckedRequest(model, stream, body)
    _check_choices(body.get("n"))
    return CheckedRequest(model, stream, _check_tokens(body, limits.max_tokens))


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_messages(messages: object, most: int) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array.", param="messages")
    if len(messages) > most:
        raise BadRequest(
            f"Too many messages ({len(messages)}); this router accepts at most {most} "
            "(its --max-messages). Shorten the conversation.",
            param="messages",
        )
    for i, message in enumerate(messages):
        _check_message(f"messages[{i}]", message)


_MESSAGE_TEXT_FIELDS = ("name", "tool_call_id", "reasoning_content")
"""Optional message fields that must be strings when present (llama-server 500s otherwise)."""


def _malformed(field: str, problem: str, param: str = "messages") -> BadRequest:
    return BadRequest(f"'{field}' {problem}.", param=param)


def _check_message(where: str, message: object) -> None:
    """One chat message, as the OpenAI API defines it (the parts llama-server trips over)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _malformed(where, "must be an object with a string 'role'")
    for field in _MESSAGE_TEXT_FIELDS:
        if field in message and not isinstance(message[field], str):
            raise _malformed(f"{where}.{field}", "must be a string")
    _check_content(where, message.get("content"))
    calls = message.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise _malformed(f"{where}.tool_calls", "must be an array")
    for j, call in enumerate(calls or ()):
        _check_function(f"{where}.tool_calls[{j}]", call, "messages", ("arguments",), ("id",))


def _check_content(where: str, content: object) -> None:
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _malformed(f"{where}.content[{j}]", "must be an object with a string 'type'")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise _malformed(f"{where}.content[{j}].text", "must be a string")
    elif content is not None and not isinstance(content, str):
        raise _malformed(f"{where}.content", "must be a string, an array of parts, or null")


def _check_tools(tools: object) -> None:
    if tools is not None and not isinstance(tools, list):
        raise _malformed("tools", "must be an array", "tools")
    for i, tool in enumerate(tools or ()):
        _check_function(f"tools[{i}]", tool, "tools", (), ("description",))


def _check_function(
    where: str, item: object, param: str, required: tuple[str, ...], optional: tuple[str, ...]
) -> None:
    """A tool or a tool call: ``{"type": "function", "function": {"name": ...}}``; the
    ``required`` and ``optional`` fields of ``function`` (``id`` of the item) are strings."""
    function = item.get("function") if isinstance(item, dict) else None
    if not (
        isinstance(item, dict)
        and item.get("type") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
    ):
        raise _malformed(where, 'must be {"type": "function", "function": {"name": ...}}', param)
    fields = {**function, **({"id": item["id"]} if "id" in item else {})}
    for field in (*required, *(f for f in optional if f in fields)):
        if not isinstance(fields.get(field), str):
            raise _malformed(f"{where}.{field}", "must be a string", param)


def _check_choices(n: object) -> None:
    if n is not None and not (_is_int(n) and 1 <= n <= MAX_CHOICES):
        raise BadRequest(f"'n' must be an integer from 1 to {MAX_CHOICES}.", param="n")


def _check_tokens(body: dict[str, Any], limit: int | None) -> dict[str, Any]:
    """``body``, or a copy with ``max_tokens`` set to ``limit`` when it names no limit."""
    for name in TOKEN_FIELDS:
        value = body.get(name)
        if value is not None:
            check_token_count(name, value, limit)
    if limit is None:
        return body
    native = body.get(NATIVE_TOKEN_FIELD)
    if native is not None and not (_is_int(native) and 0 <= native <= limit):
        raise BadRequest(
            f"'{NATIVE_TOKEN_FIELD}' must be an integer from 0 to {limit} on this router "
            "(its --max-tokens-limit).",
            param=NATIVE_TOKEN_FIELD,
        )
    if native is None and all(body.get(name) is None for name in TOKEN_FIELDS):
        return {**body, "max_tokens": limit}
    return body


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"The request body is larger than this router accepts ({limit} bytes). Send a smaller "
        "request, or start the router with a larger --max-body-bytes.",
        headers={"Connection": "close"},  # the server closes, instead of reading the rest
    )


async def read_body(chunks: AsyncIterable[bytes], headers: Headers, limit: int) -> bytes:
    """The whole body, or ``PayloadTooLarge`` as soon as it passes ``limit`` bytes.

    A ``Content-Length`` over the limit is refused before a byte is read; a chunked body is
    cut off at the first chunk past it. Nothing past the limit is kept in memory.
    """
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        parts.append(chunk)
    return b"".join(parts)
