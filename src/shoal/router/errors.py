"""Errors the router answers with; ``shoal.api_errors`` turns them into OpenAI-style JSON.

Every error a client can see is a ``RouterError``; handlers raise them and ``install``
registers the translation. Anything else becomes a 500 with no internals in the body.
"""

from __future__ import annotations

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


class NotFound(RouterError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


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
    "/v1/embeddings and /v1/models."
)


def install(app: FastAPI) -> None:
    api_errors.install(app, RouterError)
    api_errors.install_fallbacks(app, unknown_path=_UNKNOWN_PATH, server="the router")
