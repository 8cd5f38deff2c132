"""What the deployments API shows of a deployment: its plan, launch numbers and shards (pure)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from shoal.protocol.ids import WorkerId
from shoal.protocol.messages import LinkRtt, ShardRole
from shoal.router.deployments.deployment import Deployment, ShardView, StageLink, TunnelBytes
from shoal.router.deployments.launch import head_launch, holders, placed_layers
from shoal.router.deployments.placement import DeviceShare, Held, Plan
from shoal.router.dispatch.workers import Registry


def deployment_view(
    d: Deployment,
    registry: Registry,
    kv_per_layer: int,
    n_layers: int | None,
    tunnel: TunnelBytes,
    links: Mapping[str, StageLink],
) -> dict[str, Any]:
    """A deployment as ``/api/v1/pipeline/status`` shows it (and its holder publishes it).
    ``links``: each stage's tunnel, by worker id (relayed mode)."""
    launch = head_launch(d.plan) if d.plan else None
    names = {str(i): name for i, name in registry.names().items()}
    return {
        "name": d.name,
        "model": d.spec.source,
        "file": d.file.model_dump() if d.file is not None else None,
        "store": d.store.model_dump() if d.store is not None else None,
        "state": d.state.value,
        "detail": d.detail,
        "mode": d.spec.mode,
        "ctx": d.plan.ctx if d.plan else d.spec.ctx,
        "strategy": d.spec.strategy.value,
        "workers": list(d.spec.workers) if d.spec.workers is not None else None,
        "n_layers": n_layers,
        "n_gpu_layers": launch.n_gpu_layers if launch else None,
        "tensor_split": list(launch.tensor_split) if launch else None,
        "devices": list(launch.devices) if launch else None,
        "layout": d.plan.layout(names) if d.plan else [],
        "shards": [
            _shard_view(s, registry, kv_per_layer, d.plan, i)
            | {"link": link_json(s, d.spec.mode, links.get(s.worker_id))}
            for i, s in enumerate(d.shards)
        ],
        "tunnel_bytes": _bytes(tunnel),
        "last_deploy": (
            {"seconds": d.last_deploy.seconds, "tunnel_bytes": _bytes(d.last_deploy.tunnel)}
            if d.last_deploy is not None
            else None
        ),
    }


def _bytes(t: TunnelBytes) -> dict[str, int]:
    return {"to_stages": t.to_stages, "to_head": t.to_head}


RTT_MEASURES = (
    "the head: from a request of its llama-server leaving the head to the first bytes of the "
    "stage's reply reaching it (head-router-stage and back, plus the stage's work on it); "
    "reported by the head every few seconds while it serves"
)
ROUTER_RTT_MEASURES = (
    "the router's tunnel hub: from a request of the head reaching the router to the first "
    "byte of the stage's reply (router-stage round trip plus the stage's work on it)"
)


def link_json(s: ShardView, mode: str, link: StageLink | None) -> dict[str, Any] | None:
    """A stage's link to the head: the bytes its tunnel carried both ways and the RPC
    request->reply turnaround in ms (median and 90th percentile of the last ones) as the head
    timed it (``rtt_ms``; None until the head reports) and as the router's hub saw it
    (``router_rtt_ms``). None for the head; in direct mode nothing of ours relays the head's
    connection, so nothing is measured."""
    if s.role is ShardRole.HEAD:
        return None
    if mode == "direct":
        return {"measured": False, "why": "direct mode: the head dials the stage itself"}
    if link is None:
        return {"measured": False, "why": "no tunnel open to this stage"}
    router = LinkRtt.of(WorkerId(s.worker_id), link.turnarounds_ns)
    return {
        "measured": True,
        "connections": link.connections,
        "bytes_to_stage": link.carried.to_stages,
        "bytes_to_head": link.carried.to_head,
        "rtt_ms": _rtt(s.head_rtt),
        "rtt_measures": RTT_MEASURES,
        "router_rtt_ms": _rtt(router),
        "router_rtt_measures": ROUTER_RTT_MEASURES,
    }


def _rtt(r: LinkRtt | None) -> dict[str, Any] | None:
    return {"median": r.median_ms, "p90": r.p90_ms, "samples": r.samples} if r else None


def held_json(h: Held) -> dict[str, Any]:
    """What a planned shard or device holds: its layers (None: the token embedding only), bytes."""
    return {
        "layers": [h.first_layer, h.last_layer] if h.n_layers else None,
        "n_layers": h.n_layers,
        "weight_bytes": h.weight_bytes,
        "kv_bytes": h.kv_bytes,
        "compute_bytes": h.compute_bytes,
        "total_bytes": h.total_bytes,
        "free_bytes": h.free_bytes,
        "margin_bytes": h.margin_bytes,
    }


def device_json(d: DeviceShare) -> dict[str, Any]:
    """One device of a planned shard: its name and what it holds."""
    return {"device": d.device, **held_json(d)}


def _shard_view(
    s: ShardView, registry: Registry, kv_per_layer: int, plan: Plan | None, index: int
) -> dict[str, Any]:
    worker = registry.get(WorkerId(s.worker_id))
    planned = plan.shards[index] if plan is not None else None
    return {
        "worker": s.worker_id,
        "worker_name": worker.name if worker else None,
        "role": s.role.value,
        "layers": [s.first_layer, s.last_layer],
        "n_layers": s.last_layer - s.first_layer + 1,
        "devices": [device_json(d) for d in planned.devices] if planned else [],
        "state": s.state.value,
        "detail": s.detail,
        "planned_bytes": s.planned_bytes,
        "free_bytes": s.free_bytes,
        "device_free_bytes": list(s.devices),
        "build": s.build or None,
        "placement": _placement(s, registry, kv_per_layer, plan),
        "seed": s.seed.model_dump() if s.seed is not None else None,
        "last_heartbeat_s_ago": (round(time.monotonic() - worker.last_seen, 3) if worker else None),
    }


def _placement(
    s: ShardView, registry: Registry, kv_per_layer: int, plan: Plan | None
) -> list[dict[str, Any]]:
    """What the head reported it put on each device: the device by the head's name, with
    the worker and device that name stands for, and the layers its KV buffer holds."""
    placed = (
        placed_layers([p.kv_bytes for p in s.placement], kv_per_layer)
        if kv_per_layer and s.placement
        else ()
    )
    who = holders(plan) if plan is not None else {}
    out = []
    for i, p in enumerate(s.placement):
        entry: dict[str, Any] = {
            "device": p.device,
            "model_bytes": p.model_bytes,
            "kv_bytes": p.kv_bytes,
            "compute_bytes": p.compute_bytes,
        }
        if (h := who.get(p.device)) is not None:
            holder = registry.get(WorkerId(h.worker))
            entry |= {
                "worker": h.worker,
                "worker_name": holder.name if holder else None,
                "worker_device": h.device,
                "planned_layers": list(h.layers) if h.layers else None,
            }
        if placed:
            entry["layers"] = placed[i]
        out.append(entry)
    return out
