"""GET /v1/models: the models connected workers serve, under their public names."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from shoal.protocol.ids import ModelName
from shoal.protocol.messages import BackendState
from shoal.router.context import context
from shoal.router.errors import ModelNotFound
from shoal.router.routes.common import json_response

router = APIRouter()


def _model_entry(request: Request, name: str) -> dict[str, object]:
    ctx = context(request)
    served = ctx.registry.model_info(ModelName(name))
    created = int(min((w.connected_at for w, _ in served), default=0))
    ready = sum(1 for w, _ in served if w.backend_state is BackendState.READY)
    endpoints = sorted({e.path for _, m in served for e in m.endpoints})
    ctx_len = max((m.context_length or 0 for _, m in served), default=0) or None
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "shoal",
        "workers": len(served),
        "ready_workers": ready,
        "endpoints": endpoints,
        "context_length": ctx_len,
        "queued": ctx.dispatcher.queued(ModelName(name)),
    }


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """Models served by at least one connected worker."""
    ctx = context(request)
    ctx.keys.client(request.headers)
    names = sorted(ctx.registry.models())
    return json_response({"object": "list", "data": [_model_entry(request, n) for n in names]})


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> Response:
    """One model, or 404."""
    ctx = context(request)
    ctx.keys.client(request.headers)
    if model_id not in ctx.registry.models():
        raise ModelNotFound(
            f"The model {model_id!r} is not served by any connected worker.", param="model"
        )
    return json_response(_model_entry(request, model_id))
