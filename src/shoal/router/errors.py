"""Errors the router answers with, and the one place they become OpenAI-style JSON.

Every error a client can see is a ``RouterError``; handlers raise them and ``install``
registers the translation. Anything else becomes a 500 with no internals in the body.
"""

from __future__ import annotations

import logging
import math

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from shoal.protocol.messages import ErrorBody

log = logging.getLogger(__name__)


class RouterError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param
        self.retry_after = retry_after


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


def error_payload(exc: RouterError) -> dict[str, object]:
    return {
        "error": {
            "message": exc.message,
            "type": exc.type,
            "param": exc.param,
            "code": exc.code,
        }
    }


def error_response(exc: RouterError) -> Response:
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return Response(
        orjson.dumps(error_payload(exc)),
        status_code=exc.status,
        media_type="application/json",
        headers=headers,
    )


_HTTP_MESSAGES = {
    404: (
        "Unknown path {path}. Shoal serves /v1/chat/completions, /v1/completions, "
        "/v1/embeddings and /v1/models."
    ),
    405: "Method {method} is not allowed on {path}.",
}


def install(app: FastAPI) -> None:
    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        template = _HTTP_MESSAGES.get(exc.status_code, str(exc.detail))
        message = template.format(path=request.url.path, method=request.method)
        err = RouterError(message)
        err.status = exc.status_code
        err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err.code = "not_found" if exc.status_code == 404 else None
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(BadRequest(f"{loc}: {first.get('msg', 'invalid')}", param=loc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(RouterError("Internal error in the router; see its log."))
