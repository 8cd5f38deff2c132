"""A deployment's shards on the workers: the messages that start them, in order, and stop them.

A plan becomes the deployment's shards (``shard_views``: the head on the plan's first node, a
stage on each other). The stages start first: each worker gets ``ShardStart(stage)`` with its
layers (``output`` for the last, which holds the output layer). The head starts only when
every stage is ready and they all run the head's llama.cpp build (``other_builds``: llama.cpp's
RPC protocol changes between builds), because llama-server dials its ``--rpc`` peers as it
loads: in relayed mode a tunnel per stage through the router (``Tunnels``), in direct mode the
address each stage reported; with the plan's ``-ngl``/``--tensor-split`` (``launch``).
Stopping sends ``ShardStop`` to every shard's worker and closes the deployment's tunnels.

This is *how* a deployment's shards are started and stopped; *when* (the deployment's state
machine, retries, the events that drive it) is the controller's (``controller``), which keeps
apart from the messages each worker gets and the tunnels the head needs.
"""

from __future__ import annotations

import logging
from typing import Protocol

from shoal.protocol.ids import ModelName, WorkerId
from shoal.protocol.messages import RpcPeer, ShardRole, ShardStart, ShardStop
from shoal.router.deployments.deployment import Deployment, ShardView, StageLink, TunnelBytes
from shoal.router.deployments.launch import Holder, head_launch, holders, stage_devices
from shoal.router.deployments.placement import Plan
from shoal.router.dispatch.workers import Registry, WorkerConnection

log = logging.getLogger(__name__)


class Tunnels(Protocol):
    """The router's RPC tunnels: one per (deployment, stage), authenticated by secrets."""

    def open(self, deployment: str, stage: WorkerConnection) -> RpcPeer:
        """A tunnel to ``stage``'s ggml-rpc-server; the peer entry the head dials it by."""
        ...

    def close(self, deployment: str) -> None: ...

    def traffic(self, deployment: str) -> TunnelBytes:
        """What the deployment's tunnels carried so far, closed ones included."""
        ...

    def links(self, deployment: str) -> dict[str, StageLink]:
        """Each stage's open tunnel of the deployment, by the stage's worker id."""
        ...


class Shards:
    """Starts and stops deployments' shards through the connections of this router's workers."""

    def __init__(self, registry: Registry, tunnels: Tunnels) -> None:
        self.registry = registry
        self.tunnels = tunnels

    def start_stages(self, d: Deployment) -> None:
        """Send every stage of ``d`` its ``ShardStart``: its layers and the devices it serves
        them from, and the output layer to the last."""
        assert d.plan is not None
        devices = stage_devices(d.plan)
        for n, shard in enumerate(d.stages):
            start = shard_start(d, ShardRole.STAGE).model_copy(
                update={
                    "layers": (shard.first_layer, shard.last_layer),
                    "output": n == len(d.stages) - 1,
                    "devices": devices[n],
                }
            )
            self._send(shard.worker_id, start)

    def start_head(self, d: Deployment) -> str:
        """Send the head of ``d`` its ``ShardStart`` with a peer per stage; '' if sent, else
        why it could not be (a stage gave no direct address, or has no tunnel here)."""
        head = d.head
        assert head is not None and d.plan is not None
        peers: list[RpcPeer] = []
        for shard in d.stages:
            if d.spec.mode == "direct":
                if shard.rpc_address is None:
                    return f"stage {shard.worker_id} gave no direct address"
                peers.append(RpcPeer(worker_id=WorkerId(shard.worker_id), direct=shard.rpc_address))
                continue
            stage = self.registry.get(WorkerId(shard.worker_id))
            try:
                if stage is None:
                    raise RuntimeError(f"stage {shard.worker_id} is not connected here")
                peers.append(self.tunnels.open(d.name, stage))
            except RuntimeError as exc:  # the listener is not up (yet), or the stage left
                return f"no tunnel to stage {shard.worker_id}: {exc}"
        launch = head_launch(d.plan)
        start = shard_start(d, ShardRole.HEAD).model_copy(
            update={
                "peers": tuple(peers),
                "n_gpu_layers": launch.n_gpu_layers,
                "tensor_split": tuple(float(x) for x in launch.tensor_split),
                "devices": launch.devices,
            }
        )
        self._send(head.worker_id, start)
        return ""

    def stop(self, d: Deployment, why: str) -> None:
        """Stop every shard of ``d`` and close its tunnels; it keeps no plan, file or shards."""
        for shard in d.shards:
            worker = self.registry.get(WorkerId(shard.worker_id))
            if worker is not None:
                worker.send(ShardStop(deployment=d.name))
        if d.shards:
            log.info("deployment %s: shards stopped (%s)", d.name, why)
        self.tunnels.close(d.name)
        d.shards = []
        d.plan = None
        d.file = None
        d.store = None

    def _send(self, worker_id: str, msg: ShardStart) -> None:
        worker = self.registry.get(WorkerId(worker_id))
        if worker is not None:
            worker.send(msg)


def shard_views(plan: Plan) -> list[ShardView]:
    """The shards of a deployment planned with ``plan``: the head on its first node, then a
    stage on each other, as the plan lays out their layers and memory."""
    return [
        ShardView(
            worker_id=s.node_id,
            role=ShardRole.HEAD if i == 0 else ShardRole.STAGE,
            first_layer=s.first_layer,
            last_layer=s.last_layer,
            planned_bytes=s.total_bytes,
            free_bytes=s.free_bytes,
        )
        for i, s in enumerate(plan.shards)
    ]


def shard_start(d: Deployment, role: ShardRole) -> ShardStart:
    """What every shard of ``d`` in ``role`` is told, before its own part is added."""
    return ShardStart(
        deployment=d.name,
        role=role,
        model=ModelName(d.name),
        source=d.spec.source,
        file=d.file,
        store=d.store,
        ctx_size=d.plan.ctx if d.plan else d.spec.ctx,
        slots=d.spec.slots,
        direct=d.spec.mode == "direct",
    )


def other_builds(d: Deployment, reported: ShardView) -> str:
    """Why the shards cannot work together ('' if they can): llama.cpp's RPC protocol
    changes between builds, so the head and every stage must run the same one."""
    if not reported.build:
        return ""
    odd = [s for s in d.shards if s.build and s.build != reported.build]
    if not odd:
        return ""
    runs = ", ".join(f"{s.role.value} {s.worker_id} runs {s.build}" for s in odd)
    return (
        f"llama.cpp builds differ: {reported.role.value} {reported.worker_id} runs "
        f"{reported.build}, {runs}; install the same Shoal version on every worker"
    )


def placement_note(d: Deployment) -> str:
    """The serving detail: where the head reported its layers went (worker/device and MiB)."""
    head = d.head
    if head is None or not head.placement or d.plan is None:
        return "serving"
    who = holders(d.plan)
    devices = ", ".join(
        f"{where(who, p.device)} {p.model_bytes / 2**20:.1f} MiB" for p in head.placement
    )
    return f"serving; placement: {devices}"


def where(who: dict[str, Holder], device: str) -> str:
    """``worker/device`` for a device as the head names it (itself when the plan does not)."""
    h = who.get(device)
    return f"{h.worker}/{h.device}" if h is not None else device
