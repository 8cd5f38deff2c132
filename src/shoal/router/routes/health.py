"""GET /health (liveness, open) and GET /api/v1/workers (cluster view, needs a key if set)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from shoal import __version__
from shoal.router.context import context
from shoal.router.routes.common import json_response

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """The router is up. ``status`` is ``ok`` when at least one worker is ready."""
    ctx = context(request)
    workers = list(ctx.registry)
    ready = sum(1 for w in workers if w.ready)
    return json_response(
        {
            "status": "ok" if ready else "no_ready_workers",
            "version": __version__,
            "workers": len(workers),
            "ready_workers": ready,
            "models": sorted(ctx.registry.models()),
        }
    )


@router.get("/api/v1/workers")
async def workers(request: Request) -> Response:
    """Every connected worker: hardware, models, state, slots in use."""
    ctx = context(request)
    ctx.keys.client(request.headers)
    return json_response({"object": "list", "data": [w.summary() for w in ctx.registry]})
