"""Errors every Shoal server answers with, and the one place they become OpenAI-style JSON.

Each server (router, model store) subclasses ``ApiError`` for what it can refuse and calls
``install_fallbacks`` so unknown paths, bad bodies and unexpected exceptions are JSON too:
a client never sees a stack trace.
"""

from __future__ import annotations

import logging
import math

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger(__name__)


_TYPES = {403: "permission_error", 429: "rate_limit_error", 503: "unavailable_error"}


def error_type(status: int) -> str:
    """The error ``type`` that goes with an HTTP status, as OpenAI's API names them."""
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


class ApiError(Exception):
    status = 500
    type = "server_error"
    """Follows ``status`` (``error_type``) unless a subclass names its own."""
    code: str | int | None = None
    """A string of ours; a number when an error of a backend passes through (llama-server's
    ``code`` is its HTTP status, as OpenAI's own errors carry it)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "type" not in cls.__dict__:
            cls.type = error_type(cls.status)

    def __init__(
        self,
        message: str,
        *,
        code: str | int | None = None,
        param: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param
        self.headers = dict(headers or {})
        if retry_after is not None:
            self.headers["Retry-After"] = str(max(1, math.ceil(retry_after)))


class BadRequest(ApiError):
    status = 400


def error_payload(exc: ApiError) -> dict[str, object]:
    return {
        "error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
    }


def error_response(exc: ApiError) -> Response:
    return Response(
        orjson.dumps(error_payload(exc)),
        status_code=exc.status,
        media_type="application/json",
        headers=exc.headers,
    )


def install(app: FastAPI, base: type[ApiError] = ApiError) -> None:
    """Answer ``base`` errors (only) as JSON on ``app``."""

    @app.exception_handler(base)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc)


def install_fallbacks(app: FastAPI, *, unknown_path: str, server: str) -> None:
    """Unknown paths and methods, invalid bodies and unexpected exceptions, as JSON.

    ``unknown_path`` is a message template with ``{path}``; ``server`` names the server in
    the 500 message ("the router", "the model store").
    """

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = unknown_path.format(path=request.url.path)
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        else:
            message = str(exc.detail)
        err = ApiError(message, code="not_found" if exc.status_code == 404 else None)
        err.status = exc.status_code
        err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query"))
        return error_response(BadRequest(f"{loc}: {first.get('msg', 'invalid')}", param=loc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(ApiError(f"Internal error in {server}; see its log."))
