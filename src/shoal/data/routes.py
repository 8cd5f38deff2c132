"""The model store's HTTP API, as one ``APIRouter`` another FastAPI app can embed.

Reads (registry, metadata, tensors, pull plans, file bytes) need an API key when the store has
any (an admin key works too); uploads need an admin key and are disabled without one.
``install`` puts the routes, the store and its keys on an app.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
import orjson
from fastapi import APIRouter, FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from shoal.data import errors
from shoal.data.http_range import file_response
from shoal.data.keys import StoreAccess
from shoal.data.multipart import FormUpload, is_form
from shoal.data.settings import DEFAULT_MAX_UPLOAD_BYTES
from shoal.data.store import ModelStore
from shoal.models.byte_ranges import total_bytes
from shoal.models.gguf_info import to_json
from shoal.models.store_client import PullPlan

log = logging.getLogger(__name__)

router = APIRouter()

_HIDDEN_INFO_FIELDS = ("path", "tensors")
"""Left out of /metadata: the server's own path, and the tensor table (it has its own route)."""


@dataclass(frozen=True)
class StoreContext:
    store: ModelStore
    keys: StoreAccess
    max_upload_bytes: int


def install(
    app: FastAPI,
    store: ModelStore,
    *,
    access: StoreAccess,
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
) -> None:
    """Serve ``store`` from ``app``: its routes, its keys (``access``: a ``StoreKeys``), and
    its errors as JSON. Call it on the FastAPI app itself, before any ASGI wrapper goes
    around it.
    """
    app.state.model_store = StoreContext(store, access, max_upload_bytes)
    errors.install(app)
    app.include_router(router)


def _context(request: Request) -> StoreContext:
    ctx: StoreContext = request.app.state.model_store
    return ctx


async def _reader(request: Request) -> ModelStore:
    ctx = _context(request)
    await ctx.keys.check_read(request.headers)
    return ctx.store


def _json(payload: object, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def _registry(store: ModelStore) -> list[dict[str, object]]:
    return [store.registry_entry(m).model_dump() for m in store.models()]


@router.get("/api/v1/models/registry")
async def registry(request: Request) -> Response:
    """Every model in the store, with its size, sha256 and structure."""
    store = await _reader(request)
    data = await anyio.to_thread.run_sync(_registry, store)
    return _json({"object": "list", "data": data})


def _metadata(store: ModelStore, model_id: str) -> dict[str, object]:
    model = store.get(model_id)
    info = to_json(store.info(model))
    shown = {k: v for k, v in info.items() if k not in _HIDDEN_INFO_FIELDS}
    return {"id": model.id, "filename": model.filename, **shown}


@router.get("/api/v1/models/{model_id}/metadata")
async def metadata(request: Request, model_id: str) -> Response:
    """The GGUF structure: hyperparameters, key/values, layer byte ranges (no tensor table)."""
    store = await _reader(request)
    return _json(await anyio.to_thread.run_sync(_metadata, store, model_id))


def _tensors(store: ModelStore, model_id: str) -> dict[str, object]:
    model = store.get(model_id)
    return {"object": "list", "id": model.id, "data": to_json(store.info(model))["tensors"]}


@router.get("/api/v1/models/{model_id}/tensors")
async def tensors(request: Request, model_id: str) -> Response:
    """Every tensor: name, ggml type, shape, absolute data offset, size, layer."""
    store = await _reader(request)
    return _json(await anyio.to_thread.run_sync(_tensors, store, model_id))


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: tuple[int, int] = Field(description="[first, last] layer to run, both inclusive.")


def _pull(store: ModelStore, model_id: str, first: int, last: int) -> dict[str, object]:
    model = store.get(model_id)
    ranges = store.layer_ranges(model.id, first, last)
    plan = PullPlan(
        id=model.id,
        size=model.size,
        sha256=store.sha256(model),
        file_url=f"/api/v1/models/{model.id}/file",
        ranges=ranges,
        total_bytes=total_bytes(ranges),
    )
    return plan.model_dump(mode="json", by_alias=True)


@router.post("/api/v1/models/{model_id}/pull")
async def pull(request: Request, model_id: str, body: PullRequest) -> Response:
    """The byte ranges of the file that layers [first, last] need; fetch them with Range."""
    store = await _reader(request)
    first, last = body.layers
    return _json(await anyio.to_thread.run_sync(_pull, store, model_id, first, last))


_FILE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The whole GGUF file.",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    },
    206: {
        "description": "The requested byte range (Range: bytes=START-END).",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    },
}


@router.get("/api/v1/models/{model_id}/file", responses=_FILE_RESPONSES, response_class=Response)
async def model_file(request: Request, model_id: str) -> Response:
    """The GGUF file, whole or one byte range (ETag: its sha256)."""
    return await _file(request, model_id)


@router.head(
    "/api/v1/models/{model_id}/file",
    responses=_FILE_RESPONSES,
    response_class=Response,
    operation_id="model_file_head",
)
async def model_file_head(request: Request, model_id: str) -> Response:
    """The GGUF file's size and ETag, without its bytes."""
    return await _file(request, model_id)


async def _file(request: Request, model_id: str) -> Response:
    store = await _reader(request)
    opened = await store.open_file(model_id)
    return file_response(
        opened,
        head=request.method == "HEAD",
        range_header=request.headers.get("range"),
        if_range=request.headers.get("if-range"),
    )


@router.post("/api/v1/storage/upload", status_code=201)
async def upload(
    request: Request,
    model_id: str | None = Query(
        None,
        alias="id",
        description="Id of the model (its file is ID.gguf). A form may instead carry an 'id' "
        "field, or name the file ID.gguf.",
    ),
    sha256: str | None = Query(
        None,
        description="sha256 of the whole file, checked before it is kept. Required for a raw "
        "body; a form may carry it as a 'sha256' field instead (unchecked without one).",
    ),
    offset: int | None = Query(
        None,
        ge=0,
        description="Resumable upload of a raw body: the body continues the store's partial "
        "file of this sha256 from this byte (0: start over). GET /api/v1/storage/upload/SHA256 "
        "says how many bytes it holds.",
    ),
    overwrite: bool = Query(False, description="Replace a model with the same id."),
) -> Response:
    """Store a GGUF file sent as the raw request body, or as a multipart form's ``file``."""
    ctx = _context(request)
    await ctx.keys.check_admin(request.headers)
    content_type = request.headers.get("content-type")
    try:
        if is_form(content_type):
            assert content_type is not None
            if offset is not None:
                raise errors.BadRequest(
                    "A form upload cannot resume; send a raw body with ?offset=.", param="offset"
                )
            model = await ctx.store.upload_form(
                FormUpload(content_type, request.stream()),
                model_id=model_id,
                sha256=sha256,
                overwrite=overwrite,
                max_bytes=ctx.max_upload_bytes,
            )
        else:
            if model_id is None or sha256 is None:
                raise errors.BadRequest(
                    "A raw upload needs ?id=ID&sha256=SHA256 (`sha256sum FILE`), or send a "
                    "multipart form with a 'file' field.",
                    param="id" if model_id is None else "sha256",
                )
            model = await ctx.store.upload(
                model_id,
                sha256,
                request.stream(),
                overwrite=overwrite,
                declared_size=_content_length(request),
                max_bytes=ctx.max_upload_bytes,
                offset=offset,
            )
    except ClientDisconnect:
        log.info("upload of %s: the client disconnected", model_id or "a form")
        raise errors.BadRequest(
            "The upload was interrupted. A resumable upload (?offset=) keeps what arrived; "
            "any other kept nothing."
        ) from None
    digest = await anyio.to_thread.run_sync(ctx.store.sha256, model)
    return _json({"id": model.id, "size": model.size, "sha256": digest}, status=201)


@router.get("/api/v1/storage/upload/{sha256}")
async def upload_offset(request: Request, sha256: str) -> Response:
    """How many bytes of the resumable upload of ``sha256`` the store holds: resume there."""
    ctx = _context(request)
    await ctx.keys.check_admin(request.headers)
    held = await anyio.to_thread.run_sync(ctx.store.partial_upload, sha256)
    return _json({"object": "upload", "sha256": sha256.lower(), "offset": held})


def _content_length(request: Request) -> int | None:
    value = request.headers.get("content-length")
    return int(value) if value and value.isdigit() else None
