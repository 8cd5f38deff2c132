"""``GET`` and ``DELETE /v1/responses/{id}``: responses stored with ``store: true``
(``stored_responses.py``), for the key that made them. ``POST /v1/responses`` itself is an
inference route (``inference.FastPath``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from shoal.router.responses.follow_ups import find
from shoal.router.routes.context import context

router = APIRouter()


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    """A stored response, as its client got it (with ``previous_response_id``)."""
    ctx = context(request)
    principal = await ctx.keys.client(request.headers)
    return (await find(ctx.responses, response_id, principal.key_id)).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    """Forget a stored response (a follow-up can no longer name it)."""
    ctx = context(request)
    principal = await ctx.keys.client(request.headers)
    await find(ctx.responses, response_id, principal.key_id)
    await ctx.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
