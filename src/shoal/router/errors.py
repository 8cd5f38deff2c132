"""Errors the router answers with; ``shoal.api_errors`` turns them into OpenAI-style JSON.

Every error a client can see is a ``RouterError``; handlers raise them and ``install``
registers the translation. Anything else becomes a 500 with no internals in the body.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI

from shoal import api_errors
from shoal.api_errors import ApiError, error_payload, error_response
from shoal.protocol.messages import ErrorBody

__all__ = ["error_payload", "error_response"]


class RouterError(ApiError):
    """Everything the router refuses."""


class BadRequest(RouterError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(RouterError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(RouterError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class RateLimitExceeded(RouterError):
    """A key's requests/min, tokens/min or concurrent-stream limit; headers say when to retry."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class NotFound(RouterError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Conflict(RouterError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class PayloadTooLarge(RouterError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class QueueFull(RouterError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class Unavailable(RouterError):
    status = 503
    type = "unavailable_error"
    code = "no_worker_available"


class WorkerLost(RouterError):
    status = 502
    type = "server_error"
    code = "worker_lost"


class UpstreamError(RouterError):
    """An error the worker's backend returned; status and body pass through."""

    def __init__(self, status: int, error: ErrorBody) -> None:
        super().__init__(error.message)
        self.status = status
        self.type = error.type
        self.code = None if error.code is None else str(error.code)


_UNKNOWN_PATH = (
    "Unknown path {path}. Shoal serves /v1/chat/completions, /v1/completions, "
    "/v1/embeddings, /v1/images/generations, /v1/images/edits and /v1/models."
)


def install(app: FastAPI) -> None:
    api_errors.install(app, RouterError)
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
    "404 unknown model or path, 413 body too large, 429 queue full, 502/503 no worker.",
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
