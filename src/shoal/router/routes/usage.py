"""GET /api/v1/usage: requests and tokens per key and model (admin key)."""

from __future__ import annotations

import asyncio
from datetime import datetime

from fastapi import APIRouter, Request
from starlette.responses import Response

from shoal.keys import AmbiguousKey, KeyStore, UnknownKey, UsageRow
from shoal.keys.usage import hour_start, usage_since
from shoal.router.errors import BadRequest
from shoal.router.routes.common import json_response
from shoal.router.routes.context import context

router = APIRouter()


@router.get("/api/v1/usage")
async def usage(
    request: Request, since: str | None = None, key: str | None = None, model: str | None = None
) -> Response:
    """Totals per key and model; ``since`` is ``24h``, ``7d``, ``90m`` or an ISO date (UTC).

    Usage is kept per hour: the totals count from the start of the hour ``since`` falls in,
    which the answer's ``since`` says. ``key`` is an id, display prefix or name."""
    ctx = context(request)
    await ctx.keys.admin(request.headers)
    store = ctx.store
    try:
        start = usage_since(since) if since else None
    except ValueError as exc:
        raise BadRequest(f"since: {exc}", param="since") from None
    key_id = None
    if key:
        try:
            key_id = (await asyncio.to_thread(store.find, key)).id
        except (UnknownKey, AmbiguousKey) as exc:
            raise BadRequest(str(exc), param="key") from None
    rows = await asyncio.to_thread(_read, store, start, key_id, model)
    counted_from = hour_start(start).isoformat() if start else None
    data = [r.to_json() for r in rows]
    return json_response({"object": "list", "since": counted_from, "data": data})


def _read(
    store: KeyStore, start: datetime | None, key_id: str | None, model: str | None
) -> list[UsageRow]:
    store.flush_usage()  # this router's last seconds too
    return store.usage(since=start, key=key_id, model=model)
