"""What the OpenAI-compatible inference routes share: parse, check, submit, respond."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from shoal.protocol.ids import ModelName
from shoal.protocol.messages import Endpoint
from shoal.router.context import RouterContext, context
from shoal.router.errors import BadRequest, RouterError, error_response
from shoal.router.relay import JobResponse

log = logging.getLogger(__name__)

REQUIRED_FIELD = {
    Endpoint.CHAT: "messages",
    Endpoint.COMPLETIONS: "prompt",
    Endpoint.EMBEDDINGS: "input",
}

OPENAPI_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
}


def json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(
            f"The request body is not valid JSON ({exc.msg} at position {exc.pos}). "
            "Send a JSON object with Content-Type: application/json."
        ) from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def check_body(endpoint: Endpoint, body: dict[str, Any], default_model: str) -> tuple[str, bool]:
    """The public model name and whether to stream; 400 for what cannot work."""
    model = body.get("model", default_model)
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string.", param="model")
    required = REQUIRED_FIELD[endpoint]
    if required not in body:
        raise BadRequest(f"'{required}' is required for {endpoint.path}.", param=required)
    if endpoint is Endpoint.CHAT:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array.", param="messages")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false.", param="stream")
    if stream and endpoint is Endpoint.EMBEDDINGS:
        raise BadRequest("Embeddings cannot be streamed.", param="stream")
    return model, stream


def submit(ctx: RouterContext, endpoint: Endpoint, headers: Headers, raw: bytes) -> JobResponse:
    """Check key and body, queue the job, and return the response that will answer it."""
    ctx.keys.client(headers)
    body = json_body(raw)
    model, stream = check_body(endpoint, body, ctx.settings.default_model)
    job = ctx.dispatcher.submit(ModelName(model), endpoint, stream, body)
    return JobResponse(job, ctx.dispatcher)


async def run(request: Request, endpoint: Endpoint) -> JobResponse:
    return submit(context(request), endpoint, request.headers, await request.body())


FAST_PATHS = {
    "/v1/chat/completions": Endpoint.CHAT,
    "/v1/completions": Endpoint.COMPLETIONS,
    "/v1/embeddings": Endpoint.EMBEDDINGS,
}


class FastPath:
    """Serves the three inference POSTs as plain ASGI, ahead of FastAPI's middleware stack.

    Every streamed chunk would otherwise pass through five middleware ``send`` wrappers.
    The FastAPI routes below stay the documented (OpenAPI) form of the same endpoints and
    call the same ``submit``; everything else goes to FastAPI.
    """

    def __init__(self, app: ASGIApp, ctx: RouterContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = FAST_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            raw = await _read_body(receive)
            response: Response = submit(self.ctx, endpoint, Headers(scope=scope), raw)
        except RouterError as exc:
            response = error_response(exc)
        except ClientDisconnected:
            return
        except Exception:  # the one place the fast path turns a bug into a clean 500
            log.exception("unhandled error on POST %s", scope["path"])
            response = error_response(RouterError("Internal error in the router; see its log."))
        await response(scope, receive, send)


class ClientDisconnected(Exception):
    pass


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=OPENAPI_BODY)
async def chat_completions(request: Request) -> Response:
    """Chat completion, streamed (SSE) or not, passed through to a worker's backend."""
    return await run(request, Endpoint.CHAT)


@router.post("/v1/completions", openapi_extra=OPENAPI_BODY)
async def completions(request: Request) -> Response:
    """Text completion, streamed (SSE) or not, passed through to a worker's backend."""
    return await run(request, Endpoint.COMPLETIONS)


@router.post("/v1/embeddings", openapi_extra=OPENAPI_BODY)
async def embeddings(request: Request) -> Response:
    """Embeddings, from workers that serve the model with --embedding."""
    return await run(request, Endpoint.EMBEDDINGS)
