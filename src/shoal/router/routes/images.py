"""Image generation: OpenAI's ``/v1/images/generations`` (txt2img) and ``/v1/images/edits``
(img2img), and Automatic1111's ``/sdapi/v1/txt2img`` and ``/sdapi/v1/img2img`` for its clients.

Requests are checked (``router/admission/image_requests.py``) and queued like text ones, on the
image endpoints, so the scheduler hands them only to workers that serve the model for images. With
``stream: true`` the answer is SSE: one ``image_generation.progress`` event per denoising step,
then ``image_generation.completed`` with the result, then ``[DONE]``.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from shoal.jobs.events import Failed, Loading, Requeued, Result
from shoal.protocol.messages import Endpoint
from shoal.router.admission.image_requests import (
    CheckedImageRequest,
    check_image_request,
    form_fields,
    image_models,
)
from shoal.router.admission.requests import json_body, read_body
from shoal.router.errors import BadRequest, RouterError, UpstreamError
from shoal.router.routes.common import admit_and_submit, json_response
from shoal.router.routes.context import RouterContext, context
from shoal.router.routes.relay import JobResponse

log = logging.getLogger(__name__)


async def _fields(request: Request, limit: int) -> dict[str, Any]:
    try:
        raw = await read_body(request.stream(), request.headers, limit)
    except ClientDisconnect:
        raise BadRequest("The client disconnected before the request body arrived.") from None
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        return form_fields(raw, content_type)
    return json_body(raw)


async def _checked(
    ctx: RouterContext, endpoint: Endpoint, fields: dict[str, Any]
) -> CheckedImageRequest:
    served = image_models(ctx.dispatcher.worker_summaries())
    return check_image_request(endpoint, fields, served)


async def submit_image(
    ctx: RouterContext, endpoint: Endpoint, headers: Headers, fields: dict[str, Any]
) -> Response:
    """Check the key and the request, queue the job, and return the response that answers it."""
    principal = await ctx.keys.client(headers)
    checked = await _checked(ctx, endpoint, fields)
    job, ticket = await admit_and_submit(
        ctx, principal, checked.model, endpoint, checked.stream, checked.body
    )
    return JobResponse(
        job, ctx.dispatcher, ctx.accounting, ticket, timeout=ctx.settings.job_timeout
    )


async def run(request: Request, endpoint: Endpoint) -> Response:
    ctx = context(request)
    fields = await _fields(request, ctx.settings.max_body_bytes)
    return await submit_image(ctx, endpoint, request.headers, fields)


# ---------------------------------------------------------------- Automatic1111's API


def a1111_answer(result: dict[str, Any]) -> dict[str, Any]:
    """Shoal's image result as Automatic1111 answers: ``images``, ``parameters``, ``info``."""
    parameters = dict(result.get("parameters") or {})
    seeds = [item.get("seed") for item in result.get("data", ())]
    info = {**parameters, "all_seeds": seeds, "model": result.get("model")}
    return {
        "images": [item["b64_json"] for item in result.get("data", ())],
        "parameters": parameters,
        "info": orjson.dumps(info).decode(),
    }


async def run_a1111(request: Request, endpoint: Endpoint) -> Response:
    """An A1111 request: run it to the end (never streamed), answer in A1111's shape."""
    ctx = context(request)
    fields = await _fields(request, ctx.settings.max_body_bytes)
    fields.pop("stream", None)
    principal = await ctx.keys.client(request.headers)
    checked = await _checked(ctx, endpoint, fields)
    job, ticket = await admit_and_submit(
        ctx, principal, checked.model, endpoint, False, checked.body
    )
    try:
        await ctx.dispatcher.wait_assigned(job)
        while True:
            event = await job.events.get()
            if isinstance(event, Requeued):
                await ctx.dispatcher.wait_assigned(job)
            elif isinstance(event, Loading):
                continue  # its model loads: it waits on
            elif isinstance(event, Failed):
                raise UpstreamError(event.status, event.error)
            elif isinstance(event, Result):
                return json_response(a1111_answer(orjson.loads(event.body)))
            else:
                raise RouterError("The worker streamed an answer to a non-streamed image job.")
    finally:
        ctx.dispatcher.cancel(job, "request ended")
        await ctx.accounting.finish(ticket, job, None)


_IMAGE_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "prompt": {"type": "string", "minLength": 1},
        "negative_prompt": {"type": "string"},
        "n": {"type": "integer", "minimum": 1, "maximum": 8},
        "size": {"type": "string", "pattern": "^[0-9]+x[0-9]+$", "example": "512x512"},
        "response_format": {"type": "string", "enum": ["b64_json"]},
        "steps": {"type": "integer", "minimum": 1, "maximum": 150},
        "cfg_scale": {"type": "number", "minimum": 0, "maximum": 30},
        "sampler": {"type": "string"},
        "seed": {"type": "integer", "minimum": -1},
        "stream": {"type": "boolean", "description": "SSE progress events, then the result."},
    },
}
_EDIT_REQUEST: dict[str, Any] = {
    **_IMAGE_REQUEST,
    "required": ["prompt", "image"],
    "properties": {
        **_IMAGE_REQUEST["properties"],
        "image": {"type": "string", "description": "The input image (a file, or base64)."},
        "strength": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    },
}
_IMAGES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The images (b64_json PNG), with the seed and parameters used.",
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
}


def _body(schema: dict[str, Any], *media: str) -> dict[str, Any]:
    content = {m: {"schema": schema} for m in media}
    return {"requestBody": {"required": True, "content": content}}


router = APIRouter()


@router.post(
    "/v1/images/generations",
    openapi_extra=_body(_IMAGE_REQUEST, "application/json"),
    responses=_IMAGES,
)
async def generations(request: Request) -> Response:
    """Text to image, on a worker that serves the model with --image-model."""
    return await run(request, Endpoint.IMAGE_GENERATIONS)


@router.post(
    "/v1/images/edits",
    openapi_extra=_body(_EDIT_REQUEST, "multipart/form-data", "application/json"),
    responses=_IMAGES,
)
async def edits(request: Request) -> Response:
    """Image to image from an uploaded image (``strength``: how much of it changes)."""
    return await run(request, Endpoint.IMAGE_EDITS)


@router.post("/sdapi/v1/txt2img", openapi_extra=_body(_IMAGE_REQUEST, "application/json"))
async def sdapi_txt2img(request: Request) -> Response:
    """Automatic1111-compatible txt2img."""
    return await run_a1111(request, Endpoint.IMAGE_GENERATIONS)


@router.post("/sdapi/v1/img2img", openapi_extra=_body(_EDIT_REQUEST, "application/json"))
async def sdapi_img2img(request: Request) -> Response:
    """Automatic1111-compatible img2img (``init_images``, ``denoising_strength``)."""
    return await run_a1111(request, Endpoint.IMAGE_EDITS)


@router.get("/sdapi/v1/sd-models")
async def sdapi_models(request: Request) -> Response:
    """The image models the cluster serves, as Automatic1111 lists checkpoints."""
    ctx = context(request)
    await ctx.keys.client(request.headers)
    names = image_models(ctx.dispatcher.worker_summaries())
    return json_response([{"title": n, "model_name": n, "hash": None} for n in names])
