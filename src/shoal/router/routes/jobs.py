"""Async jobs: ``POST /v1/jobs`` queues a request and answers 202; ``GET /v1/jobs/{id}``
tells its status and, once it has ended, its result or error; ``DELETE`` cancels it.

The body of ``POST /v1/jobs`` is the request body of the endpoint its ``type`` names, plus
``type``: ``{"type": "chat_completion", "messages": [...], "temperature": 0}``. It is checked
like the synchronous request (same limits, same 400s, a 404 for a model no worker serves)
before anything is queued; async jobs are never streamed. The 202 shows where the job stands
once the router knows (``JobsService.submit``): its ``queue_position``, or running. A job
is visible only to the API key that created it (another key gets 404).

Dependencies come from the app: ``install`` puts the ``JobsApi`` in ``app.state.jobs_api``; the
composition root sets ``app.state.check_key`` (headers in, the ``Owner`` out: key id and how
its requests queue; or 401).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from shoal.protocol.ids import ModelName
from shoal.protocol.messages import Endpoint
from shoal.router.admission.image_requests import check_image_request
from shoal.router.admission.image_requests import image_models as image_models_of
from shoal.router.admission.requests import (
    CheckedRequest,
    RequestLimits,
    check_body,
    json_body,
    read_body,
)
from shoal.router.async_jobs.records import JobRecord, JobStatus, JobType
from shoal.router.async_jobs.service import JobsService, Owner
from shoal.router.errors import BadRequest
from shoal.router.routes.common import json_response

KeyCheckFn = Callable[[Headers], Owner | Awaitable[Owner]]
"""Checks a request's API key (plain or async): its ``Owner`` (key id None when the router has
no keys), or raises 401/403."""

_TYPES = ", ".join(t.value for t in JobType)


ServedCheck = Callable[[ModelName, Endpoint], None]
"""Raises the 404/400/503 a request for a model no worker could take gets (``Dispatcher``'s
``check_served``): an async job for it is refused at submit, like the request itself."""


@dataclass(frozen=True)
class JobsApi:
    service: JobsService
    limits: RequestLimits
    default_model: str
    check_served: ServedCheck


@dataclass(frozen=True)
class JobRequest:
    type: JobType
    request: CheckedRequest


def install(
    app: FastAPI,
    service: JobsService,
    *,
    limits: RequestLimits,
    default_model: str,
    check_served: ServedCheck,
) -> None:
    """Serve the jobs routes on ``app`` with ``service`` (``app.state.check_key`` is needed)."""
    app.state.jobs_api = JobsApi(service, limits, default_model, check_served)
    app.include_router(router)


def parse_job_request(
    data: dict[str, Any],
    default_model: str,
    limits: RequestLimits,
    image_models: Sequence[str] = (),
) -> JobRequest:
    """The job to run, or a 400 naming the field (``type``, ``stream``, or the body's own)."""
    body = dict(data)
    raw_type = body.pop("type", None)
    if raw_type is None:
        raise BadRequest(f"'type' is required: one of {_TYPES}.", param="type")
    try:
        job_type = JobType(raw_type)
    except ValueError:
        raise BadRequest(
            f"Unknown job type {raw_type!r}. Valid types: {_TYPES}.", param="type"
        ) from None
    if body.get("stream") is True:
        raise BadRequest(
            "Async jobs are never streamed: leave out 'stream' and read the result with "
            "GET /v1/jobs/{id}, or call the endpoint directly to stream.",
            param="stream",
        )
    if job_type.endpoint.is_image:
        image = check_image_request(job_type.endpoint, body, image_models)
        return JobRequest(job_type, CheckedRequest(image.model, False, image.body))
    return JobRequest(job_type, check_body(job_type.endpoint, body, default_model, limits))


def _api(request: Request) -> JobsApi:
    api: JobsApi = request.app.state.jobs_api
    return api


async def _owner(request: Request) -> Owner:
    check: KeyCheckFn | None = getattr(request.app.state, "check_key", None)
    if check is None:
        raise RuntimeError("app.state.check_key is not set: the composition root must set it")
    owner = check(request.headers)
    return await owner if inspect.isawaitable(owner) else owner


def _job(record: JobRecord, status: int = 200) -> Response:
    response = json_response(record.to_api(), status)
    if status == 202:
        response.headers["location"] = f"/v1/jobs/{record.id}"
    return response


_JOB_TYPES: dict[str, Any] = {"type": "string", "enum": [t.value for t in JobType]}
JOB_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {**_JOB_TYPES, "description": "Which endpoint's request the rest of the body is."},
        "model": {"type": "string", "minLength": 1},
        "stream": {"type": "boolean", "enum": [False], "description": "Never true here."},
    },
    "additionalProperties": True,
    "description": "The request body of /v1/chat/completions (chat_completion), "
    "/v1/completions (completion), /v1/embeddings (embedding), /v1/images/generations "
    "(txt2img) or /v1/images/edits (img2img, the image base64 in 'image'), plus 'type'. "
    "Image jobs show their step progress in 'progress' while they run.",
}
_NULLABLE_OBJECT: dict[str, Any] = {"type": ["object", "null"]}
_NULLABLE_TIME: dict[str, Any] = {"type": ["integer", "null"]}
JOB_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "type", "model", "status", "created_at"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string", "enum": ["job"]},
        "type": _JOB_TYPES,
        "model": {"type": "string"},
        "status": {"type": "string", "enum": [s.value for s in JobStatus]},
        "created_at": {"type": "integer"},
        "finished_at": _NULLABLE_TIME,
        "expires_at": _NULLABLE_TIME,
        "result": {**_NULLABLE_OBJECT, "description": "The endpoint's answer, once succeeded."},
        "error": {**_NULLABLE_OBJECT, "description": "An OpenAI error object, once failed."},
        "progress": _NULLABLE_OBJECT,
        "queue_position": {
            "type": ["integer", "null"],
            "description": "While queued on a router without Redis: jobs that will go first.",
        },
    },
}
_JOB_CONTENT = {"application/json": {"schema": JOB_SCHEMA}}

router = APIRouter()


@router.post(
    "/v1/jobs",
    status_code=202,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": JOB_REQUEST_SCHEMA}},
        }
    },
    responses={202: {"description": "Queued; poll GET /v1/jobs/{id}.", "content": _JOB_CONTENT}},
)
async def create_job(request: Request) -> Response:
    """Queue a chat completion, completion or embedding to run in the background."""
    api = _api(request)
    owner = await _owner(request)
    try:
        raw = await read_body(request.stream(), request.headers, api.limits.max_body_bytes)
    except ClientDisconnect:
        raise BadRequest("The client disconnected before the request body arrived.") from None
    ctx = getattr(request.app.state, "ctx", None)
    served = image_models_of(ctx.dispatcher.worker_summaries()) if ctx is not None else []
    job = parse_job_request(json_body(raw), api.default_model, api.limits, served)
    api.check_served(ModelName(job.request.model), job.type.endpoint)
    record = await api.service.submit(job.type, job.request.model, job.request.body, owner)
    return _job(record, 202)


@router.get(
    "/v1/jobs/{job_id}",
    responses={200: {"description": "The job.", "content": _JOB_CONTENT}},
)
async def get_job(request: Request, job_id: str) -> Response:
    """A job's status, and its result or error once it has ended."""
    return _job(await _api(request).service.get(job_id, (await _owner(request)).key_id))


@router.delete(
    "/v1/jobs/{job_id}",
    responses={200: {"description": "The job, now cancelled.", "content": _JOB_CONTENT}},
)
async def cancel_job(request: Request, job_id: str) -> Response:
    """Cancel a queued or running job (409 if it has already ended)."""
    return _job(await _api(request).service.cancel(job_id, (await _owner(request)).key_id))
