"""Errors the model store answers with, and the one place they become OpenAI-style JSON.

Every error a client can see is a ``DataError``. ``install`` registers its translation on an
app that embeds the store (that app keeps its own handlers for everything else);
``install_all`` also translates unknown paths, validation errors and unexpected exceptions,
for the store's own app.
"""

from __future__ import annotations

from fastapi import FastAPI

from shoal import api_errors
from shoal.api_errors import ApiError


class DataError(ApiError):
    """Everything the model store refuses."""


class BadRequest(DataError):
    status = 400


class NotGGUF(BadRequest):
    code = "not_gguf"


class ChecksumMismatch(BadRequest):
    code = "sha256_mismatch"


class Unauthorized(DataError):
    status = 401
    code = "invalid_api_key"


class Forbidden(DataError):
    """A working key of a scope that may not do this (an inference key uploading)."""

    status = 403
    code = "forbidden"


class UploadsDisabled(DataError):
    status = 403
    code = "uploads_disabled"


class ModelNotFound(DataError):
    status = 404
    code = "model_not_found"


class ModelExists(DataError):
    status = 409
    code = "model_exists"


class ModelChanged(DataError):
    status = 409
    code = "model_changed"


class UploadConflict(DataError):
    """A resumed upload's offset is not where the store's partial file ends, or another
    upload of the same bytes is running."""

    status = 409
    code = "upload_offset_mismatch"


class TooLarge(DataError):
    status = 413
    code = "upload_too_large"


class RangeNotSatisfiable(DataError):
    status = 416
    code = "range_not_satisfiable"


class KeysUnavailable(DataError):
    status = 503
    code = "key_database_unavailable"


class UnreadableModel(DataError):
    """A file in the store that is not a GGUF the store can describe (put there by hand)."""

    code = "unreadable_model"


def install(app: FastAPI) -> None:
    """Translate ``DataError`` (only) into OpenAI-style JSON on ``app``."""
    api_errors.install(app, DataError)


_UNKNOWN_PATH = (
    "Unknown path {path}. The model store serves GET /api/v1/models/registry, "
    "/api/v1/models/ID/metadata, /tensors, /file, POST /api/v1/models/ID/pull and "
    "POST /api/v1/storage/upload."
)


def install_all(app: FastAPI) -> None:
    """``install``, plus unknown paths, bad requests and unexpected errors as JSON too."""
    install(app)
    api_errors.install_fallbacks(app, unknown_path=_UNKNOWN_PATH, server="the model store")
