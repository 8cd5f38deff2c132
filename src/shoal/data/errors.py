"""Errors the model store answers with, and the one place they become OpenAI-style JSON.

Every error a client can see is a ``DataError``. ``install`` registers its translation on an
app that embeds the store (that app keeps its own handlers for everything else);
``install_all`` also translates unknown paths, validation errors and unexpected exceptions,
for the store's own app.
"""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger(__name__)


class DataError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}


class BadRequest(DataError):
    status = 400
    type = "invalid_request_error"


class NotGGUF(BadRequest):
    code = "not_gguf"


class ChecksumMismatch(BadRequest):
    code = "sha256_mismatch"


class Unauthorized(DataError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class UploadsDisabled(DataError):
    status = 403
    type = "permission_error"
    code = "uploads_disabled"


class ModelNotFound(DataError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class ModelExists(DataError):
    status = 409
    type = "invalid_request_error"
    code = "model_exists"


class ModelChanged(DataError):
    status = 409
    type = "invalid_request_error"
    code = "model_changed"


class TooLarge(DataError):
    status = 413
    type = "invalid_request_error"
    code = "upload_too_large"


class RangeNotSatisfiable(DataError):
    status = 416
    type = "invalid_request_error"
    code = "range_not_satisfiable"


class UnreadableModel(DataError):
    """A file in the store that is not a GGUF the store can describe (put there by hand)."""

    code = "unreadable_model"


def error_payload(exc: DataError) -> dict[str, object]:
    return {
        "error": {
            "message": exc.message,
            "type": exc.type,
            "param": exc.param,
            "code": exc.code,
        }
    }


def error_response(exc: DataError) -> Response:
    return Response(
        orjson.dumps(error_payload(exc)),
        status_code=exc.status,
        media_type="application/json",
        headers=exc.headers,
    )


def install(app: FastAPI) -> None:
    """Translate ``DataError`` (only) into OpenAI-style JSON on ``app``."""

    @app.exception_handler(DataError)
    async def _data_error(request: Request, exc: DataError) -> Response:
        return error_response(exc)


_UNKNOWN_PATH = (
    "Unknown path {path}. The model store serves GET /api/v1/models/registry, "
    "/api/v1/models/ID/metadata, /tensors, /file, POST /api/v1/models/ID/pull and "
    "POST /api/v1/storage/upload."
)


def install_all(app: FastAPI) -> None:
    """``install``, plus unknown paths, bad requests and unexpected errors as JSON too."""
    install(app)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = _UNKNOWN_PATH.format(path=request.url.path)
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        else:
            message = str(exc.detail)
        err = DataError(message)
        err.status = exc.status_code
        err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err.code = "not_found" if exc.status_code == 404 else None
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query"))
        return error_response(BadRequest(f"{loc}: {first.get('msg', 'invalid')}", param=loc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(DataError("Internal error in the model store; see its log."))
