"""GET /v1/models: the models connected workers serve, under their public names, each with
its state and, in Shoal's extension fields, where it is resident (``residency``: how many
workers hold it loaded, could load it, are loading it), its resident bytes and its last
load time; ``GET /v1/models/{id}`` names each worker (``placements``).

``POST /api/v1/models/load|unload`` (admin key): image models on every worker serving them
(or the one named); text models of workers that report a per-model state (several text
models per worker) on one worker: the one named, else the one a job would load it on
(``scheduler.choose``: free memory first, then the cheapest eviction). 404: nobody serves
it; 409: no worker can now (it does not fit beside pinned or busy models, or is not loaded
anywhere to unload); 400: a model loaded for as long as its worker runs."""

from __future__ import annotations

from collections import Counter
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from shoal.models.residency import Admit
from shoal.protocol.ids import ModelName, WorkerId
from shoal.protocol.messages import BackendState, ModelControl, ModelInfo
from shoal.router.dispatch.scheduler import admission, choose
from shoal.router.dispatch.worker_names import resolve_workers
from shoal.router.dispatch.workers import WorkerConnection
from shoal.router.errors import BadRequest, Conflict, ModelNotFound
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


_RESIDENCY = {
    BackendState.READY: "resident",
    BackendState.UNLOADED: "loadable",
    BackendState.LOADING: "loading",
    BackendState.RESTARTING: "loading",
    BackendState.FAILED: "failed",
}
"""A worker's state for a model, as residency (``/v1/models``)."""


def residency_counts(states: Counter[BackendState]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for state, n in states.items():
        counts[_RESIDENCY[state]] += n
    return dict(sorted(counts.items()))


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
    sizes = [m.resident_bytes for _, _, m in remote if m.resident_bytes is not None]
    loads = [m.load_seconds for _, _, m in remote if m.load_seconds is not None]
    if view is not None:
        states.update(view.states)
        created.append(min(view.created))
        endpoints |= {e.path for e in view.endpoints}
        contexts += [n or 0 for n in view.context]
        sizes += view.resident_bytes.keys()
        loads += view.load_seconds.keys()
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
        "residency": residency_counts(states),
        "resident_bytes": max(sizes, default=None),
        "load_seconds": max(loads, default=None),
    }


def _placements(request: Request, name: ModelName) -> list[dict[str, object]]:
    """Each worker serving ``name``, with its residency there (``GET /v1/models/{id}``)."""
    ctx = context(request)
    served = [
        (w.id, w.name, m.state or w.backend_state, m) for w, m in ctx.registry.model_info(name)
    ]
    for r in ctx.dispatcher.remote_workers():
        served += [
            (r.id, str(r.summary.get("name", r.id)), m.state or r.state, m)
            for m in r.models
            if m.name == name
        ]
    return [
        {
            "worker": worker_id,
            "worker_name": worker_name,
            "residency": _RESIDENCY[state],
            "resident_bytes": m.resident_bytes,
            "load_seconds": m.load_seconds,
            "pinned": m.pinned,
            "loads": m.loads,
            "evictions": m.evictions,
        }
        for worker_id, worker_name, state, m in sorted(served, key=lambda s: s[0])
    ]


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
    entry = _model_entry(request, model_id)
    entry["placements"] = _placements(request, ModelName(model_id))
    return json_response(entry)


class ControlRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        description="A model that loads and unloads on request: an image model, or a text "
        "model of a worker serving several."
    )
    worker: str | None = Field(None, description="Only this worker (name or id); default: all.")


@router.post("/api/v1/models/load", status_code=202)
async def load_model(request: Request, body: ControlRequest) -> Response:
    """Load a model now (making room as a job would): an image model on the workers that
    serve it, a text model on one (module docstring)."""
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
            "and unload on their own (image models, and text models of a worker serving "
            "several) can be loaded or unloaded on request. Use --idle-unload on the worker to "
            "free a text model's memory when idle.",
            param="model",
        )
    own = [(w, m) for w, m in served if m.state is not None]
    if any(e.is_image for _, m in own for e in m.endpoints):
        told = [_tell(w, m, action) for w, m in own]
    elif action == "load":
        told = [_load_text(own, ModelName(body.model))]
    else:
        told = _unload_text(own, body.model)
    return json_response({"model": body.model, "action": action, "workers": told}, status=202)


def _tell(
    worker: WorkerConnection,
    info: ModelInfo,
    action: Literal["load", "unload"],
    evict: tuple[str, ...] | None = None,
) -> dict[str, object]:
    worker.send(ModelControl(model=info.name, action=action))
    told: dict[str, object] = {"worker": worker.id, "worker_name": worker.name, "was": info.state}
    if evict is not None:
        told["evicts"] = list(evict)
    return told


def _load_text(
    served: list[tuple[WorkerConnection, ModelInfo]], model: ModelName
) -> dict[str, object]:
    """Load a text model on one worker: the only one named, else where a job would load it;
    409 when none can now, saying why."""
    by_id: dict[WorkerId, tuple[WorkerConnection, ModelInfo]] = {w.id: (w, m) for w, m in served}
    if len(served) > 1:
        endpoint = served[0][1].endpoints[0]
        chosen = choose([w.load() for w, _ in served], model, endpoint)
        if chosen is not None:
            worker, info = by_id[chosen.worker]
            return _tell(worker, info, "load", chosen.evict)
    why = []
    for worker, info in served:
        load = worker.load()
        own = load.model(model)
        if own is None:
            continue
        decision = admission(load, own)
        if isinstance(decision, Admit) and worker.available:
            return _tell(worker, info, "load", decision.evict)
        reason = "it takes no jobs now" if isinstance(decision, Admit) else decision.reason
        why.append(f"{worker.name} ({worker.id}): {reason}")
    raise Conflict(
        f"No worker can load {model!r} now. " + "; ".join(why), param="model", code="cannot_load"
    )


def _unload_text(
    served: list[tuple[WorkerConnection, ModelInfo]], model: str
) -> list[dict[str, object]]:
    """Unload a text model where it is loaded (or loading); 409 where it is not."""
    loaded = [(w, m) for w, m in served if m.state is not BackendState.UNLOADED]
    if not loaded:
        raise Conflict(
            f"{model!r} is not loaded on any worker named; nothing to unload.",
            param="model",
            code="not_loaded",
        )
    return [_tell(w, m, "unload") for w, m in loaded]
