"""What the OpenAI-compatible inference routes share: read, check, submit, respond.

A request is read and checked (``router/admission/requests.py``) before it is queued, then admitted
against its key's limits, answered from the result cache or queued for a worker.

The FastAPI routes at the end are the documented (OpenAPI) form of the same endpoints; their
request schemas are what tests/e2e/test_fuzz.py fuzzes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from shoal.protocol.messages import AGENT_ENDPOINTS, WS_PATH, Endpoint
from shoal.router.admission.requests import (
    MAX_CHOICES,
    TOKEN_FIELDS,
    RequestLimits,
    check_body,
    json_body,
    read_body,
)
from shoal.router.admission.result_cache.interface import CacheFill, cache_key, cache_policy, replay
from shoal.router.dispatch.job import JobState
from shoal.router.errors import BadRequest, RouterError, error_reply
from shoal.router.responses import follow_ups as stored_responses
from shoal.router.routes.common import admit_and_submit
from shoal.router.routes.context import RouterContext, context
from shoal.router.routes.dialects import dialect_of
from shoal.router.routes.relay import JobResponse
from shoal.router.routes.worker_socket import serve_worker

log = logging.getLogger(__name__)


async def submit(ctx: RouterContext, endpoint: Endpoint, headers: Headers, raw: bytes) -> Response:
    """Check key, body and the key's limits, queue the job, and return the response that will
    answer it."""
    principal = await ctx.keys.client(headers)
    limits = RequestLimits.of(ctx.settings)
    checked = check_body(endpoint, json_body(raw), ctx.settings.default_model, limits)
    keeper = None
    if endpoint is Endpoint.RESPONSES:  # a follow-up made whole; what keeps store: true
        body, keeper = await stored_responses.prepare(ctx.responses, principal.key_id, checked.body)
        checked = dataclasses.replace(checked, body=body)
    fill = None
    dialect = dialect_of(endpoint)
    if ctx.cache is not None and keeper is None and (dialect.caches_streams or not checked.stream):
        # hits are answered here and cost the key nothing
        key = cache_key(checked.model, endpoint, checked.body, scope=principal.key_id)
        policy = cache_policy(headers)
        if key is not None and policy.read and (hit := await ctx.cache.get(key)) is not None:
            return replay(hit, stream=checked.stream)
        if key is not None and policy.write:
            fill = CacheFill(ctx.cache, key, stream=checked.stream)
    job, ticket = await admit_and_submit(
        ctx,
        principal,
        checked.model,
        endpoint,
        checked.stream,
        checked.body,
        max_tokens=_reserve(checked.body),
    )
    if job.state is JobState.ASSIGNED:
        # Its worker's start frame is queued for the socket's writer: let it leave now, and
        # set the response up while the worker starts the job, not before.
        await asyncio.sleep(0)
    return JobResponse(
        job,
        ctx.dispatcher,
        ctx.accounting,
        ticket,
        fill,
        timeout=ctx.settings.job_timeout,
        dialect=dialect,
        keep=keeper.keep if keeper is not None else None,
    )


def _reserve(body: dict[str, Any]) -> int:
    """Tokens to hold against a tokens/min limit until the answer's real count is known."""
    for field in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


async def run(request: Request, endpoint: Endpoint) -> Response:
    ctx = context(request)
    try:
        raw = await read_body(request.stream(), request.headers, ctx.settings.max_body_bytes)
    except ClientDisconnect:
        raise BadRequest("The client disconnected before the request body arrived.") from None
    return await submit(ctx, endpoint, request.headers, raw)


FAST_PATHS = {
    endpoint.path: endpoint
    for endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.EMBEDDINGS, *AGENT_ENDPOINTS)
}
"""The POSTs served here; the Responses and Messages APIs only here (they are not in the
OpenAPI document: it describes OpenAI's own API)."""


class FastPath:
    """Serves the inference POSTs, and the workers' WebSocket (``WS_PATH``), as plain ASGI,
    ahead of FastAPI's middleware stack and routing.

    Every streamed chunk would otherwise pass through five middleware ``send`` wrappers.
    The FastAPI routes below stay the documented (OpenAPI) form of the same endpoints and
    call the same ``submit``; everything else goes to FastAPI.
    """

    def __init__(self, app: ASGIApp, ctx: RouterContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and scope.get("path") == WS_PATH:
            await serve_worker(WebSocket(scope, receive, send), self.ctx)
            return
        endpoint = FAST_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        started = time.monotonic()
        try:
            raw = await read_body(_chunks(receive), headers, self.ctx.settings.max_body_bytes)
            response: Response = await submit(self.ctx, endpoint, headers, raw)
        except RouterError as exc:
            response = error_reply(exc, render=dialect_of(endpoint).error_response)
        except ClientDisconnected:
            return
        except Exception:  # the one place the fast path turns a bug into a clean 500
            log.exception("unhandled error on POST %s", scope["path"])
            bug = RouterError("Internal error in the router; see its log.")
            response = error_reply(bug, render=dialect_of(endpoint).error_response)
        try:
            await response(scope, receive, send)
        finally:
            status = response.status_code or CLIENT_CLOSED
            elapsed = time.monotonic() - started
            self.ctx.accounting.metrics.request_finished(scope["path"], status, elapsed)


CLIENT_CLOSED = 499
"""Status counted for a response the client left before it started (nginx's convention)."""


class ClientDisconnected(Exception):
    pass


async def _chunks(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


_TEXT: dict[str, Any] = {"type": "string", "maxLength": 4096}
_TOKEN_IDS: dict[str, Any] = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_MESSAGE: dict[str, Any] = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant"]},
        "content": _TEXT,
        "name": {"type": "string", "maxLength": 64},
    },
}
_COMMON: dict[str, Any] = {
    "model": {
        "type": "string",
        "minLength": 1,
        "description": "A model from GET /v1/models. Default: the router's --default-model.",
    },
    "user": {"type": "string", "maxLength": 256},
}
_GENERATION: dict[str, Any] = {
    **_COMMON,
    "stream": {"type": "boolean", "default": False, "description": "Answer as SSE events."},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean"}},
    },
    **{
        name: {
            "type": ["integer", "null"],
            "minimum": 1,
            "description": "Most tokens to generate; the router may cap it (--max-tokens-limit).",
        }
        for name in TOKEN_FIELDS
    },
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "seed": {"type": "integer"},
    "stop": {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "maxItems": 4}]},
}
CHAT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        **_GENERATION,
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    },
}
COMPLETION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        **_GENERATION,
        "prompt": {"anyOf": [_TEXT, {"type": "array", "items": _TEXT}, _TOKEN_IDS]},
    },
}
EMBEDDING_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["input"],
    "properties": {
        **_COMMON,
        "input": {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1}]},
        "encoding_format": {"type": "string", "enum": ["float", "base64"]},
    },
}


def _request_body(schema: dict[str, Any], example: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` declaring a JSON request body (the handlers read it themselves)."""
    media = {"schema": schema, "example": example}
    return {"requestBody": {"required": True, "content": {"application/json": media}}}


_HELLO = {"role": "user", "content": "Say hello."}


_OBJECT = {"schema": {"type": "object"}}
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "A JSON chunk, or [DONE]."}},
}
_GENERATED: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The answer as JSON; with stream=true, SSE events ending in [DONE].",
        "content": {
            "application/json": _OBJECT,
            "text/event-stream": {"schema": _SSE_EVENT},
        },
    }
}
_EMBEDDED: dict[int | str, dict[str, Any]] = {
    200: {"description": "The embeddings.", "content": {"application/json": _OBJECT}}
}

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    openapi_extra=_request_body(CHAT_SCHEMA, {"messages": [_HELLO], "max_tokens": 8}),
    responses=_GENERATED,
)
async def chat_completions(request: Request) -> Response:
    """Chat completion, streamed (SSE) or not, passed through to a worker's backend."""
    return await run(request, Endpoint.CHAT)


@router.post(
    "/v1/completions",
    openapi_extra=_request_body(COMPLETION_SCHEMA, {"prompt": "Once upon a time", "max_tokens": 8}),
    responses=_GENERATED,
)
async def completions(request: Request) -> Response:
    """Text completion, streamed (SSE) or not, passed through to a worker's backend."""
    return await run(request, Endpoint.COMPLETIONS)


@router.post(
    "/v1/embeddings",
    openapi_extra=_request_body(EMBEDDING_SCHEMA, {"input": "Hello"}),
    responses=_EMBEDDED,
)
async def embeddings(request: Request) -> Response:
    """Embeddings, from workers that serve the model with --embedding."""
    return await run(request, Endpoint.EMBEDDINGS)
