"""Deployments shared between routers: the stored deployments reloaded while this router
edits them, and leases renewed while the database fails (real Redis, a prefix per test)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from deployment_rig import FakeTunnels, connect, router_pin, specs

from shoal.keys.errors import DatabaseError
from shoal.router.deployments import sharing as deployment_sharing
from shoal.router.deployments.controller import Deployments
from shoal.router.deployments.deployment import DeploymentSpec, DeploymentState
from shoal.router.deployments.leases import DeploymentLeases
from shoal.router.deployments.placement import Strategy
from shoal.router.deployments.sources import ModelSources
from shoal.router.deployments.store import DeploymentStore
from shoal.router.dispatch.workers import Registry


class SlowStore(DeploymentStore):
    """Stands in for the database with a read that stays open until the test lets it end."""

    def __init__(self, specs: list[DeploymentSpec]) -> None:
        self.specs = list(specs)
        self.reading = threading.Event()
        self.release = threading.Event()

    def load(self) -> list[DeploymentSpec]:
        snapshot = list(self.specs)
        self.reading.set()
        self.release.wait(5)
        return snapshot

    def save(self, spec: DeploymentSpec) -> None:
        self.specs = [s for s in self.specs if s.name != spec.name] + [spec]

    def delete(self, name: str) -> bool:
        self.specs = [s for s in self.specs if s.name != name]
        return True


async def test_a_read_that_overlaps_an_undeploy_here_is_not_applied(model_path: Path) -> None:
    """With several routers, deployments are reloaded every few seconds; a reload that read
    the table before this router's own undeploy must not bring the deployment back."""
    spec = DeploymentSpec("split", str(model_path), 1024, Strategy.BALANCED, None, "relayed")
    store = SlowStore([spec])
    controller = Deployments(
        Registry(), store, FakeTunnels(), ModelSources(model_path.parent), pin=router_pin
    )
    store.release.set()
    await controller.load()
    assert await controller.stored() == [spec]  # nothing under way: the read counts
    store.release.clear()
    store.reading.clear()
    reading = asyncio.create_task(controller.stored())
    await asyncio.to_thread(store.reading.wait, 5)  # the read has its snapshot, with "split"
    await controller.undeploy("split")
    store.release.set()
    assert await reading is None  # stale: skipped, the next sync reads again
    assert await controller.stored() == []


class BrokenStore(SlowStore):
    """Stands in for a database that has stopped answering."""

    def load(self) -> list[DeploymentSpec]:
        raise DatabaseError("cannot read the deployments: the database failed: gone")


async def test_a_failing_database_does_not_stop_the_splits_this_router_runs(
    model_path: Path, redis_prefix: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(deployment_sharing, "SYNC_S", 0.1)  # renewals well within the TTL
    registry = Registry()
    for name in "abc":
        connect(registry, name)
    client = aioredis.Redis(host="127.0.0.1", port=6379)
    try:
        leases = DeploymentLeases(client, redis_prefix, "router-a", ttl_s=0.5)
        controller = Deployments(
            registry,
            specs(tmp_path),
            FakeTunnels(),
            ModelSources(model_path.parent),
            leases,
            pin=router_pin,
        )
        spec = DeploymentSpec("split", str(model_path), 1024, Strategy.BALANCED, None, "relayed")
        await controller.deploy(spec)
        sharing = controller.sharing
        assert sharing is not None
        task = asyncio.create_task(controller.run())
        try:
            async with asyncio.timeout(5):
                while "split" not in sharing.mine:
                    await asyncio.sleep(0.01)
            controller.store = BrokenStore([])  # the database goes away
            await asyncio.sleep(1.5)  # three lease lifetimes: renewed all along
            assert "split" in sharing.mine
            assert controller.items["split"].state is DeploymentState.STARTING
            other = DeploymentLeases(client, redis_prefix, "router-b", ttl_s=0.5)
            assert await other.hold("split") == "router-a"
        finally:
            task.cancel()
    finally:
        await client.aclose()
