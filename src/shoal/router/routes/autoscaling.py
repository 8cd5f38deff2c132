"""GET /api/v1/autoscaling: each model's scaling signals over the cluster (admin key).

The figures of the ``shoal_cluster_*`` gauges (``router/observe/autoscaling.py``), as JSON an
autoscaler reads without Prometheus (KEDA's ``metrics-api`` trigger:
``models.<model>.queue_depth``). With Redis every router answers for the whole cluster.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from shoal.router.routes.common import json_response
from shoal.router.routes.context import context
from shoal.router.routes.snapshot import autoscaling

router = APIRouter()


@router.get("/api/v1/autoscaling")
async def scaling_signals(request: Request) -> Response:
    """Per model: ``queue_depth``, ``oldest_wait_s``, ``ready_slots``, ``busy_slots``,
    ``workers``, ``draining_workers``."""
    ctx = context(request)
    await ctx.keys.admin(request.headers)
    per_model = autoscaling(ctx.registry, ctx.dispatcher)
    return json_response(
        {
            "object": "autoscaling",
            "scope": "cluster" if ctx.dispatcher.queue_backend == "redis" else "router",
            "models": {model: s.as_json() for model, s in per_model.items()},
        }
    )
