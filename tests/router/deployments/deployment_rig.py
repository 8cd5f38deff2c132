"""What the deployments tests share: worker connections without sockets in a registry, the
router's tunnels stood in for, and a deployment of the real default model over three workers."""

from __future__ import annotations

from pathlib import Path

from shoal.keys.db import make_engine, resolve_database
from shoal.keys.migrate import upgrade
from shoal.protocol.messages import (
    Message,
    ModelFile,
    RpcPeer,
    ShardRole,
    ShardState,
    ShardStatus,
    decode_router_message,
)
from shoal.router.deployments.controller import Deployments
from shoal.router.deployments.deployment import DeploymentSpec, StageLink, TunnelBytes
from shoal.router.deployments.pin import pin_model
from shoal.router.deployments.placement import Strategy
from shoal.router.deployments.sources import ModelSources
from shoal.router.deployments.store import DeploymentStore
from shoal.router.dispatch.workers import Registry, WorkerConnection
from socketless import worker_connection

GIB = 2**30


class FakeTunnels:
    """Stands in for the router's tunnel listener (no sockets in these tests)."""

    def __init__(self) -> None:
        self.closed: list[str] = []
        self.carried: dict[str, TunnelBytes] = {}
        self.stage_links: dict[str, dict[str, StageLink]] = {}

    def open(self, deployment: str, stage: WorkerConnection) -> RpcPeer:
        return RpcPeer(
            worker_id=stage.id, tunnel_id=f"t-{stage.id}", tunnel_token="s", tunnel_port=1
        )

    def close(self, deployment: str) -> None:
        self.closed.append(deployment)

    def traffic(self, deployment: str) -> TunnelBytes:
        return self.carried.get(deployment, TunnelBytes())

    def links(self, deployment: str) -> dict[str, StageLink]:
        return self.stage_links.get(deployment, {})


def connect(registry: Registry, name: str, ram: int = 8 * GIB) -> WorkerConnection:
    worker = worker_connection(name, ram_bytes=ram)
    registry.add(worker)
    return worker


def sent(worker: WorkerConnection) -> list[Message]:
    out = []
    while not worker.outbox.empty():
        out.append(decode_router_message(worker.outbox.get_nowait()))
    return out


def status(
    worker: WorkerConnection, role: ShardRole, state: ShardState, build: str = "b1"
) -> ShardStatus:
    return ShardStatus(deployment="split", role=role, state=state, build=build)


def router_pin(source: str) -> ModelFile | None:
    """The router's own pinning, with an empty cache (these tests deploy paths: None)."""
    return pin_model(source, Path("/nonexistent/shoal-cache"))


def specs(folder: Path) -> DeploymentStore:
    """The deployments table in a SQLite file of its own, migrated as a router's is."""
    engine = make_engine(resolve_database(f"sqlite:///{folder / 'shoal.db'}"))
    upgrade(engine)
    return DeploymentStore(engine)


async def deployed(model_path: Path, registry: Registry, folder: Path) -> Deployments:
    controller = Deployments(
        registry, specs(folder), FakeTunnels(), ModelSources(model_path.parent), pin=router_pin
    )
    spec = DeploymentSpec(
        "split", str(model_path), 1024, Strategy.BALANCED, ("a", "b", "c"), "relayed"
    )
    await controller.deploy(spec)
    return controller
