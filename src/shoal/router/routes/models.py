"""GET /v1/models: the models connected workers serve, under their public names."""

from __future__ import annotations

from collections import Counter
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from shoal.protocol.ids import ModelName
from shoal.protocol.messages import BackendState, ModelControl, ModelInfo
from shoal.router.dispatch.worker_names import resolve_workers
from shoal.router.errors import BadRequest, ModelNotFound
from shoal.router.routes.common import json_response
from shoal.router.routes.context import context

router = APIRouter()


_STATE_ORDER = (
    BackendState.READY,
    BackendState.UNLOADED,
    BackendState.LOADING,
    BackendState.RESTARTING,
    BackendState.FAILED,
)


def model_state(states: Counter[BackendState]) -> str:
    """A model's state is the best of its workers': ready beats unloaded beats loading..."""
    return next((s.value for s in _STATE_ORDER if states[s]), BackendState.FAILED.value)


def _remote(request: Request, name: ModelName) -> list[tuple[BackendState, float, ModelInfo]]:
    """Other routers' workers serving ``name`` (with Redis), as of the last directory sync."""
    served = []
    for r in context(request).dispatcher.remote_workers():
        served += [(m.state or r.state, r.connected_at, m) for m in r.models if m.name == name]
    return served


def _model_names(request: Request) -> set[str]:
    ctx = context(request)
    remote = {m.name for r in ctx.dispatcher.remote_workers() for m in r.models}
    return {*ctx.registry.model_names(), *remote}


def _model_entry(request: Request, name: str) -> dict[str, object]:
    """One model's entry: this router's workers from its per-model view (``model_views``),
    other routers' (with Redis) from the directory."""
    ctx = context(request)
    view = ctx.registry.view(ModelName(name))
    remote = _remote(request, ModelName(name))
    states = Counter(state for state, _, _ in remote)
    created = [int(at) for _, at, _ in remote]
    endpoints = {e.path for _, _, m in remote for e in m.endpoints}
    contexts = [m.context_length or 0 for _, _, m in remote]
    if view is not None:
        states.update(view.states)
        created.append(min(view.created))
        endpoints |= {e.path for e in view.endpoints}
        contexts += [n or 0 for n in view.context]
    return {
        "id": name,
        "object": "model",
        "created": min(created, default=0),
        "owned_by": "shoal",
        "workers": sum(states.values()),
        "ready_workers": states[BackendState.READY],
        "state": model_state(states),
        "workers_by_state": {state.value: n for state, n in sorted(states.items())},
        "endpoints": sorted(endpoints),
        "context_length": max(contexts, default=0) or None,
        "queued": ctx.dispatcher.queue_depths().get(ModelName(name), 0),
    }


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """Models served by at least one connected worker."""
    ctx = context(request)
    await ctx.keys.client(request.headers)
    names = sorted(_model_names(request))
    return json_response({"object": "list", "data": [_model_entry(request, n) for n in names]})


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> Response:
    """One model, or 404."""
    ctx = context(request)
    await ctx.keys.client(request.headers)
    if model_id not in _model_names(request):
        raise ModelNotFound(
            f"The model {model_id!r} is not served by any connected worker.", param="model"
        )
    return json_response(_model_entry(request, model_id))


class ControlRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="A model that loads and unloads on request (image models).")
    worker: str | None = Field(None, description="Only this worker (name or id); default: all.")


@router.post("/api/v1/models/load", status_code=202)
async def load_model(request: Request, body: ControlRequest) -> Response:
    """Load a model now on the workers that serve it (making room as a job would)."""
    return await _control(request, body, "load")


@router.post("/api/v1/models/unload", status_code=202)
async def unload_model(request: Request, body: ControlRequest) -> Response:
    """Unload a model on the workers that serve it; its next job loads it again."""
    return await _control(request, body, "unload")


async def _control(
    request: Request, body: ControlRequest, action: Literal["load", "unload"]
) -> Response:
    ctx = context(request)
    await ctx.keys.admin(request.headers)
    only = None
    if body.worker is not None:
        [only] = resolve_workers([body.worker], ctx.registry.names(), param="worker")
    served = [
        (w, m)
        for w, m in ctx.registry.model_info(ModelName(body.model))
        if only is None or w.id == only
    ]
    if not served:
        raise ModelNotFound(
            f"No worker connected to this router serves {body.model!r}"
            + (f" as {body.worker!r}" if body.worker else "")
            + ". GET /v1/models lists what is served.",
            param="model",
        )
    if all(m.state is None for _, m in served):
        raise BadRequest(
            f"{body.model!r} is loaded for as long as its worker runs; only models that load "
            "and unload on their own (image models) can be loaded or unloaded on request. "
            "Use --idle-unload on the worker to free a text model's memory when idle.",
            param="model",
        )
    told = []
    for worker, info in served:
        if info.state is not None:
            worker.send(ModelControl(model=info.name, action=action))
            told.append({"worker": worker.id, "worker_name": worker.name, "was": info.state})
    return json_response({"model": body.model, "action": action, "workers": told}, status=202)
