"""What the OpenAI-compatible inference routes share: parse, check, submit, respond."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from shoal.protocol.ids import ModelName
from shoal.protocol.messages import Endpoint
from shoal.router.context import context
from shoal.router.errors import BadRequest
from shoal.router.relay import JobResponse, json_body

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


async def run(request: Request, endpoint: Endpoint) -> JobResponse:
    ctx = context(request)
    ctx.keys.client(request.headers)
    body = json_body(await request.body())
    model, stream = check_body(endpoint, body, ctx.settings.default_model)
    job = ctx.dispatcher.submit(ModelName(model), endpoint, stream, body)
    return JobResponse(job, ctx.dispatcher)


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
