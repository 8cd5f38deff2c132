"""What a request to the Responses or Messages API may be (pure; ``requests.check_body`` calls
it for those endpoints after the checks every request gets).

The body goes to llama-server as the client sent it, so only what Shoal itself needs is
checked here: the messages (Messages API) as far as llama-server trips over them, the token
limit in each API's own field (``max_output_tokens``, ``max_tokens``), and what the pinned
llama-server would silently ignore where a client relies on it: a Messages request's
structured output (``output_config.format``; llama-server's Anthropic converter drops it)
is refused with a 400 that says what works instead. What ``previous_response_id`` names is
``stored_responses``'s.
"""

from __future__ import annotations

from typing import Any

from shoal.protocol.messages import Endpoint
from shoal.router.admission.token_limit import check_token_count
from shoal.router.errors import BadRequest

TOKEN_FIELD = {
    Endpoint.RESPONSES: "max_output_tokens",
    Endpoint.MESSAGES: "max_tokens",
    Endpoint.COUNT_TOKENS: "max_tokens",
}
"""Each API's name for the most tokens to generate."""
ANTHROPIC_FORMATS = ("output_config", "output_format")
"""Where Anthropic's API takes a JSON schema for the answer (``output_format``: its beta)."""


def check_agent_body(endpoint: Endpoint, body: dict[str, Any], limit: int | None) -> dict[str, Any]:
    """``body`` to forward, or a 400 for what cannot work or is over the token ``limit``
    (a request that names no limit gets it, as on the other routes)."""
    previous = body.get("previous_response_id")
    if endpoint is Endpoint.RESPONSES and previous is not None and not isinstance(previous, str):
        raise BadRequest(
            "'previous_response_id' must be a string: the id of a response stored with "
            "store: true.",
            param="previous_response_id",
        )
    if endpoint is not Endpoint.RESPONSES:
        _check_structured_output(body)
    if endpoint is Endpoint.COUNT_TOKENS:
        return body
    field = TOKEN_FIELD[endpoint]
    value = body.get(field)
    if value is None:
        return body if limit is None else {**body, field: limit}
    check_token_count(field, value, limit)
    return body


def _check_structured_output(body: dict[str, Any]) -> None:
    for field in ANTHROPIC_FORMATS:
        asked = body.get(field)
        if field == "output_config" and isinstance(asked, dict):
            asked = asked.get("format")  # its other settings (effort) are no schema
        if asked is None:
            continue
        raise BadRequest(
            f"'{field}' (structured output) is not supported on /v1/messages here: the "
            "workers' llama-server ignores it, so the answer would not follow the schema. "
            "Give the schema as a tool's input_schema with tool_choice "
            '{"type": "tool", "name": ...}, or use /v1/responses (text.format) or '
            "/v1/chat/completions (response_format).",
            param=field,
        )
