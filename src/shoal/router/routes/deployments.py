"""The deployments API: plan a split model, deploy it, watch it, take it down.

All routes need the admin key and keep the paths they were first published under,
``/api/v1/pipeline/...``. ``plan`` is a dry run: it reads the GGUF's structure, takes the
connected workers' free memory from their heartbeats and returns the pure planner's answer;
a model that does not fit is an answer too (``fits: false`` with the shortfall), not an
error. ``deploy`` answers at once (202) with the deployment as it stands; its shards start
in the background and ``status`` follows them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from shoal.models.errors import ModelError, StoreUnreachable
from shoal.models.gguf_info import GGUFInfo
from shoal.models.stage_tensors import stage_tensors
from shoal.protocol.ids import WorkerId
from shoal.router.deployments.controller import DeploymentError, Deployments
from shoal.router.deployments.deployment import NAME_RE, DeploymentSpec
from shoal.router.deployments.launch import head_launch, stage_devices, too_many_devices
from shoal.router.deployments.nodes import planning_nodes
from shoal.router.deployments.placement import NoFit, Shard, Strategy
from shoal.router.deployments.profile import plan_for
from shoal.router.deployments.sources import Located
from shoal.router.deployments.views import device_json, held_json
from shoal.router.dispatch.worker_names import UnknownWorkers, resolve_workers
from shoal.router.errors import BadRequest, Conflict, ModelNotFound, NotFound, StoreUnavailable
from shoal.router.routes.common import json_response
from shoal.router.routes.context import context

router = APIRouter()


class PlanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        description="A known model id, the path of a .gguf file on the router, or the id of a "
        "model in a model store the router is given (--storage, --model-store)."
    )
    workers: list[str] | None = Field(
        None,
        description="Worker names or ids in shard order (the first is the head: runs "
        "llama-server). Default: every connected worker that can run shards.",
    )
    ctx: int = Field(4096, ge=1, le=1 << 24, description="Total context (KV cells).")
    strategy: Strategy = Strategy.PROPORTIONAL


class DeployRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        description="A model id the router knows, the path of a .gguf file, or the id of a "
        "model in a model store the router is given (--storage, --model-store)."
    )
    name: str | None = Field(
        None, description="Public name to serve it under (default: the model id)."
    )
    workers: list[str] | None = Field(
        None,
        description="Worker names or ids in shard order; the first is the head "
        "(runs llama-server). Default: every connected worker, by name.",
    )
    ctx: int = Field(4096, ge=256, le=1 << 22, description="Total context (KV cells).")
    strategy: Strategy = Strategy.PROPORTIONAL
    mode: Literal["relayed", "direct"] = Field(
        "relayed",
        description="relayed: RPC through the router's authenticated tunnel (no inbound port "
        "on any worker); direct: the head dials the stages' --rpc-host (trusted LANs only).",
    )
    slots: int = Field(1, ge=1, le=64, description="Requests the split model serves at once.")


class NameRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The deployment's name (its public model name).")


class RebalanceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, description="One deployment (default: all).")


def _controller(request: Request) -> Deployments:
    return context(request).deployments


@router.post("/api/v1/pipeline/plan")
async def plan_pipeline(request: Request, body: PlanRequest) -> Response:
    """Dry run: the layer split over workers for a model at a context size, as JSON."""
    ctx = context(request)
    await ctx.keys.admin(request.headers)
    located = await _locate(ctx.deployments, body.model)
    info = located.info
    nodes = planning_nodes(ctx.registry, body.workers)
    planned = plan_for(info, nodes, body.ctx, body.strategy)
    cells, result = planned.cells, planned.result
    answer: dict[str, Any] = {
        "model": located.id,
        "store": located.store.model_dump() if located.store is not None else None,
        "n_layers": info.n_layers,
        "ctx": cells,
    }
    if isinstance(result, NoFit):
        answer.update(
            fits=False,
            needed_bytes=result.needed_bytes,
            available_bytes=result.available_bytes,
            shortfall_bytes=result.shortfall_bytes,
            reason=result.reason,
        )
    else:
        names = ctx.registry.names()
        launch = head_launch(result)
        answer.update(
            fits=True,
            refused=too_many_devices(result),
            strategy=result.strategy.value,
            head_worker=result.shards[0].node_id,
            tensor_split=list(result.tensor_split),
            layout=result.layout({str(i): name for i, name in names.items()}),
            head={
                "n_gpu_layers": launch.n_gpu_layers,
                "devices": list(launch.devices),
                "tensor_split": list(launch.tensor_split),
            },
            stage_devices=[list(d) for d in stage_devices(result)],
            shards=[
                _shard_json(s, names, info, i, len(result.shards))
                for i, s in enumerate(result.shards)
            ],
        )
    return json_response(answer)


@router.get("/api/v1/pipeline/models")
async def pipeline_models(request: Request) -> Response:
    """The split models: name, model file and state."""
    await context(request).keys.admin(request.headers)
    data = [
        {"id": d["name"], "object": "model", "model": d["model"], "state": d["state"]}
        for d in _controller(request).status()
    ]
    return json_response({"object": "list", "data": data})


@router.post("/api/v1/pipeline/deploy", status_code=202)
async def deploy(request: Request, body: DeployRequest) -> Response:
    """Split a model over workers and serve it; 202 with the deployment's state."""
    ctx = context(request)
    await ctx.keys.admin(request.headers)
    name = body.name or _default_name(body.model)
    if not NAME_RE.match(name):
        raise BadRequest(
            f"{name!r} is not a usable model name: use letters, digits and . _ : / - "
            "(up to 128), starting with a letter or digit.",
            param="name",
        )
    if body.workers is not None:
        # A shared name or a worker named twice is refused; workers not connected here are
        # not: the deployment waits for them (they may start later, or dial another router).
        with contextlib.suppress(UnknownWorkers):
            resolve_workers(body.workers, ctx.registry.names())
    spec = DeploymentSpec(
        name=name,
        source=body.model,
        ctx=body.ctx,
        strategy=body.strategy,
        workers=tuple(body.workers) if body.workers is not None else None,
        mode=body.mode,
        slots=body.slots,
    )
    controller = _controller(request)
    try:
        await controller.deploy(spec)
    except StoreUnreachable as exc:
        raise StoreUnavailable(str(exc), param="model") from None
    except ModelError as exc:
        raise ModelNotFound(str(exc), param="model") from None
    except DeploymentError as exc:
        raise Conflict(str(exc), param="name") from None
    return json_response(_one(controller, name), status=202)


@router.post("/api/v1/pipeline/undeploy")
async def undeploy(request: Request, body: NameRequest) -> Response:
    await context(request).keys.admin(request.headers)
    controller = _controller(request)
    gone = await controller.undeploy(body.name)
    if gone is None:
        raise NotFound(_unknown(controller, body.name), param="name")
    return json_response({"name": body.name, "state": "undeployed"})


@router.get("/api/v1/pipeline/status")
async def status(request: Request) -> Response:
    """Every deployment with its shards: worker, layers, state, memory, last heartbeat."""
    await context(request).keys.admin(request.headers)
    return json_response({"object": "list", "data": _controller(request).status()})


@router.post("/api/v1/pipeline/rebalance")
async def rebalance(request: Request, body: RebalanceRequest) -> Response:
    """Plan again over the workers connected now; redeploy where the plan changed."""
    await context(request).keys.admin(request.headers)
    controller = _controller(request)
    if body.name is not None and body.name not in controller.items:
        raise NotFound(_unknown(controller, body.name), param="name")
    chosen = controller.rebalance(body.name)
    return json_response({"object": "list", "data": [_one(controller, d.name) for d in chosen]})


async def _locate(controller: Deployments, model: str) -> Located:
    """``model`` on the router or in a model store; 404 when nowhere, 503 when a store that
    might have it could not be asked."""
    try:
        return await controller.sources.locate(model)
    except StoreUnreachable as exc:
        raise StoreUnavailable(str(exc), param="model") from None
    except ModelError as exc:
        raise ModelNotFound(str(exc), param="model") from None


def _one(controller: Deployments, name: str) -> dict[str, object]:
    return next(d for d in controller.status() if d["name"] == name)


def _unknown(controller: Deployments, name: str) -> str:
    known = ", ".join(sorted(controller.items)) or "none"
    return f"No deployment is named {name!r}. Deployments: {known}."


def _default_name(model: str) -> str:
    """The model id; for a path, the file name without ``.gguf``."""
    tail = model.rstrip("/").rsplit("/", 1)[-1]
    return tail[: -len(".gguf")] if tail.lower().endswith(".gguf") else model


def _shard_json(
    shard: Shard, names: dict[WorkerId, str], info: GGUFInfo, index: int, count: int
) -> dict[str, Any]:
    # A stage pre-seeds the tensors llama.cpp would look up by hash: the head sends it only
    # the rest (a head keeps its own layers and sends nothing).
    seeded = (
        sum(
            t.nbytes
            for t in stage_tensors(info, shard.first_layer, shard.last_layer, index == count - 1)
        )
        if index > 0
        else 0
    )
    return {
        "worker": shard.node_id,
        "worker_name": names.get(WorkerId(shard.node_id)),
        "role": shard.role,
        **held_json(shard),
        "devices": [device_json(d) for d in shard.devices],
        "preseed_bytes": seeded,
    }
