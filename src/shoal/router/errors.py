"""Errors the router answers with; ``shoal.api_errors`` turns them into OpenAI-style JSON.

Every error a client can see is a ``RouterError``; handlers raise them and ``install``
registers the translation. Anything else becomes a 500 with no internals in the body.
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from shoal import api_errors
from shoal.api_errors import ApiError, error_payload, error_response
from shoal.protocol.messages import ErrorBody

__all__ = ["error_payload", "error_response"]

REQUEST_ID = "x-request-id"
WORKER_ID = "x-shoal-worker"


class RouterError(ApiError):
    """Everything the router refuses."""


class BadRequest(RouterError):
    status = 400


class Unauthorized(RouterError):
    status = 401
    code = "invalid_api_key"


class Forbidden(RouterError):
    status = 403
    code = "forbidden"


class RateLimitExceeded(RouterError):
    """A key's requests/min, tokens/min or concurrent-stream limit; headers say when to retry."""

    status = 429
    code = "rate_limit_exceeded"


class NotFound(RouterError):
    status = 404
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Conflict(RouterError):
    status = 409
    code = "conflict"


class PayloadTooLarge(RouterError):
    status = 413
    code = "request_too_large"


class QueueFull(RouterError):
    status = 429
    code = "queue_full"


class Unavailable(RouterError):
    status = 503
    code = "no_worker_available"


class ModelDoesNotFit(RouterError):
    """Every worker serving the model (as one of several text models) could never load it:
    it is too big for their budgets, or does not fit beside their pinned models."""

    status = 503
    code = "model_does_not_fit"


class StoreUnavailable(RouterError):
    """A model store the router asks for a split model could not be reached."""

    status = 503
    code = "model_store_unavailable"


class WorkerLost(RouterError):
    status = 502
    code = "worker_lost"


class JobTimedOut(RouterError):
    status = 504
    code = "job_timeout"

    def __init__(self, limit: float) -> None:
        super().__init__(
            f"This request took longer than the router's limit of {limit:g} s (its "
            "--job-timeout) and was stopped. Ask for fewer tokens (max_tokens) or a shorter "
            "prompt, or ask the router's administrator to raise --job-timeout."
        )


class UpstreamError(RouterError):
    """An error the worker's backend returned; status and body pass through."""

    def __init__(self, status: int, error: ErrorBody) -> None:
        super().__init__(error.message)
        self.status = status
        self.type = error.type
        self.code = error.code  # as the backend sent it: llama-server's is a number


_UNKNOWN_PATH = (
    "Unknown path {path}. Shoal serves /v1/chat/completions, /v1/completions, "
    "/v1/embeddings, /v1/responses, /v1/messages, /v1/messages/count_tokens, "
    "/v1/images/generations, /v1/images/edits and /v1/models."
)


def new_request_id() -> str:
    """The id of a request refused before it became a job (a job's id is its request id)."""
    return "req_" + secrets.token_hex(8)


def error_reply(
    exc: ApiError,
    request_id: str | None = None,
    worker_id: str | None = None,
    render: Callable[[ApiError], Response] = error_response,
) -> Response:
    """``exc`` as the router answers it: with ``x-request-id`` (the job's id, or a new one for
    a request refused before it was queued; the job id is in the logs) and, when a worker
    answered with the error, ``x-shoal-worker``, like every answer. ``render``: the error's
    body and status in the request's API (``dialects``: OpenAI's, unless it is Anthropic's)."""
    response = render(exc)
    response.headers[REQUEST_ID] = request_id or new_request_id()
    if worker_id:
        response.headers[WORKER_ID] = worker_id
    return response


def install(app: FastAPI) -> None:
    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> Response:
        return error_reply(exc)

    api_errors.install_fallbacks(app, unknown_path=_UNKNOWN_PATH, server="the router")


ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
_DEFAULT_RESPONSE = {
    "description": "An error, OpenAI-style: 400 invalid request, 401 missing or wrong key, "
    "404 unknown model or path, 413 body too large, 429 queue full, 502/503 no worker, "
    "504 --job-timeout passed.",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
}


def document_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (OpenAPI) with the router's error answers declared on every operation.

    FastAPI documents a 422 the router never sends (invalid input is a 400 here); every
    error is the same OpenAI-style JSON, so it becomes each operation's ``default`` response.
    """
    result = copy.deepcopy(schema)
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    for operations in result.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            responses.setdefault("default", _DEFAULT_RESPONSE)
    return result
