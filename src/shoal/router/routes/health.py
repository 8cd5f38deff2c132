"""GET /health (liveness, open) and GET /api/v1/workers (cluster view, needs a key if set)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from shoal import __version__
from shoal.router.errors import Unavailable
from shoal.router.routes.common import json_response
from shoal.router.routes.context import context

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """The router is up. ``status`` is ``ok`` when at least one worker is ready.

    With Redis (``"queue": "redis"``) the workers and models are the cluster's: this
    router's and, as of the worker directory's last sync, every other router's. No Redis
    call is made here, so the answer stays cheap (the endpoint is open). ``open_scopes``:
    the key scopes this router serves without a key (the dashboard skips its sign-in when
    ``admin`` and ``inference`` are), null while the key database cannot say."""
    ctx = context(request)
    try:
        open_scopes: list[str] | None = [s.value for s in await ctx.keys.open_scopes()]
    except Unavailable:  # the key database is down: liveness does not depend on it
        open_scopes = None
    remote = ctx.dispatcher.remote_workers()
    ready = ctx.registry.ready()
    ready += sum(1 for r in remote if r.ready)
    models = {*ctx.registry.model_names(), *(m.name for r in remote for m in r.models)}
    return json_response(
        {
            "status": "ok" if ready else "no_ready_workers",
            "version": __version__,
            "queue": ctx.dispatcher.queue_backend,
            "workers": len(ctx.registry) + len(remote),
            "ready_workers": ready,
            "models": sorted(models),
            "open_scopes": open_scopes,
        }
    )


@router.get("/api/v1/workers")
async def workers(request: Request) -> Response:
    """Every connected worker: hardware, models, state, slots in use (admin key).

    With Redis, the workers of every router on it, each marked with its ``router``."""
    ctx = context(request)
    await ctx.keys.admin(request.headers)
    return json_response({"object": "list", "data": ctx.dispatcher.worker_summaries()})
