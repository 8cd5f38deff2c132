"""What the deployments API shows of a deployment: its plan, launch numbers and shards (pure)."""

from __future__ import annotations

import time
from typing import Any

from shoal.protocol.ids import WorkerId
from shoal.router.deployments.deployment import Deployment, ShardView, TunnelBytes
from shoal.router.deployments.launch import head_launch, placed_layers
from shoal.router.workers import Registry


def deployment_view(
    d: Deployment,
    registry: Registry,
    kv_per_layer: int,
    n_layers: int | None,
    tunnel: TunnelBytes,
) -> dict[str, Any]:
    """A deployment as ``/api/v1/pipeline/status`` shows it (and its holder publishes it)."""
    launch = head_launch(d.plan, [s.devices for s in d.stages]) if d.plan else None
    return {
        "name": d.name,
        "model": d.spec.source,
        "file": d.file.model_dump() if d.file is not None else None,
        "state": d.state.value,
        "detail": d.detail,
        "mode": d.spec.mode,
        "ctx": d.plan.ctx if d.plan else d.spec.ctx,
        "strategy": d.spec.strategy.value,
        "workers": list(d.spec.workers) if d.spec.workers is not None else None,
        "n_layers": n_layers,
        "n_gpu_layers": launch.n_gpu_layers if launch else None,
        "tensor_split": list(launch.tensor_split) if launch else None,
        "shards": [_shard_view(s, registry, kv_per_layer) for s in d.shards],
        "tunnel_bytes": _bytes(tunnel),
        "last_deploy": (
            {"seconds": d.last_deploy.seconds, "tunnel_bytes": _bytes(d.last_deploy.tunnel)}
            if d.last_deploy is not None
            else None
        ),
    }


def _bytes(t: TunnelBytes) -> dict[str, int]:
    return {"to_stages": t.to_stages, "to_head": t.to_head}


def _shard_view(s: ShardView, registry: Registry, kv_per_layer: int) -> dict[str, Any]:
    worker = registry.get(WorkerId(s.worker_id))
    placed = (
        placed_layers([p.kv_bytes for p in s.placement], kv_per_layer)
        if kv_per_layer and s.placement
        else ()
    )
    return {
        "worker": s.worker_id,
        "worker_name": worker.name if worker else None,
        "role": s.role.value,
        "layers": [s.first_layer, s.last_layer],
        "n_layers": s.last_layer - s.first_layer + 1,
        "state": s.state.value,
        "detail": s.detail,
        "planned_bytes": s.planned_bytes,
        "free_bytes": s.free_bytes,
        "device_free_bytes": list(s.devices),
        "build": s.build or None,
        "placement": [
            {"device": p.device, "model_bytes": p.model_bytes, "kv_bytes": p.kv_bytes}
            | ({"layers": placed[i]} if placed else {})
            for i, p in enumerate(s.placement)
        ],
        "seed": s.seed.model_dump() if s.seed is not None else None,
        "last_heartbeat_s_ago": (round(time.monotonic() - worker.last_seen, 3) if worker else None),
    }
