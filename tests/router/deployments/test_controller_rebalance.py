"""Rebalancing a serving deployment: a worker that joins and makes the plan better, drained
first; one that does not, ignored; ``rebalance()`` on demand. Real controller, registry and
worker connections without sockets; the real default model's GGUF to plan from."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from deployment_rig import FakeTunnels, connect, router_pin, sent, specs, status

from shoal.protocol.ids import JobId, ModelName, WorkerId
from shoal.protocol.messages import (
    BackendState,
    Endpoint,
    LinkRtt,
    ShardLinks,
    ShardRole,
    ShardStart,
    ShardState,
    ShardStop,
)
from shoal.router.deployments.controller import Deployments
from shoal.router.deployments.deployment import (
    DeploymentSpec,
    DeploymentState,
    ShardView,
    StageLink,
    TunnelBytes,
)
from shoal.router.deployments.placement import Strategy
from shoal.router.deployments.sources import ModelSources
from shoal.router.deployments.views import link_json
from shoal.router.dispatch.job import Job
from shoal.router.dispatch.workers import Registry, WorkerConnection

MIB = 2**20


async def serving(
    model_path: Path, registry: Registry, folder: Path, quiet_s: float = 0.0
) -> Deployments:
    """``split`` of the default model over the workers there are, served (any worker)."""
    controller = Deployments(
        registry,
        specs(folder),
        FakeTunnels(),
        ModelSources(model_path.parent),
        pin=router_pin,
        rebalance_quiet_s=quiet_s,
    )
    spec = DeploymentSpec("split", str(model_path), 1024, Strategy.PROPORTIONAL, None, "relayed")
    await controller.deploy(spec)
    d = controller.items["split"]
    workers = [registry.get(WorkerId(s.worker_id)) for s in d.shards]
    for w, s in zip(workers, d.shards, strict=True):
        assert w is not None
        if s.role is ShardRole.STAGE:
            controller.on_shard(w, status(w, ShardRole.STAGE, ShardState.READY))
    head = workers[0]
    assert head is not None
    controller.on_shard(head, status(head, ShardRole.HEAD, ShardState.READY))
    assert d.state is DeploymentState.SERVING
    for w in registry:
        sent(w)
    return controller


def answering(head: WorkerConnection, model: str) -> JobId:
    """An answer of ``model`` running on ``head`` (as the dispatcher holds it)."""
    job = Job(JobId("j1"), ModelName(model), Endpoint.CHAT, True, {})
    head.hold(job.id, job)
    return job.id


async def test_a_worker_that_makes_the_plan_better_drains_then_switches(
    model_path: Path, tmp_path: Path
) -> None:
    registry = Registry()
    a, b = (connect(registry, n, 200 * MIB) for n in "ab")
    controller = await serving(model_path, registry, tmp_path)
    d = controller.items["split"]
    assert [s.worker_id for s in d.shards] == ["a", "b"]
    run = answering(a, "split")

    c = connect(registry, "c", 1000 * MIB)
    controller.on_registered(c)
    assert sent(c) == [ShardStop(deployment="split")]  # nothing of it runs there
    controller._reconcile(d, time.monotonic())  # the quiet period (0 s here) is over
    assert d.state is DeploymentState.DRAINING
    assert "fullest worker's share of its memory drops from 72% to 56%" in d.detail
    assert controller.unavailable(ModelName("split")) is not None  # no new request meanwhile
    assert sent(a) == [] and sent(b) == []  # the head still answers
    controller._reconcile(d, d.retry_at)
    assert d.state is DeploymentState.DRAINING

    a.running.pop(run)  # the answer ended
    controller._reconcile(d, d.retry_at)
    assert sent(a) == [ShardStop(deployment="split")]  # the head starts when its stages are up
    stop, start = sent(b)  # b's shard stops, its new one starts
    assert stop == ShardStop(deployment="split") and isinstance(start, ShardStart)
    assert d.state is DeploymentState.STARTING  # planned again at once, over three workers
    assert [s.worker_id for s in d.shards] == ["a", "b", "c"], (d.state, d.detail)
    assert [s.first_layer for s in d.shards] == [0, 4, 8]
    assert all(isinstance(m, ShardStart) for m in sent(c))


async def test_a_worker_that_would_not_improve_the_plan_changes_nothing(
    model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    registry = Registry()
    for n in "ab":
        connect(registry, n, 4096 * MIB)  # plenty: a third worker gains little
    controller = await serving(model_path, registry, tmp_path)
    d = controller.items["split"]
    c = connect(registry, "c", 4096 * MIB)
    controller.on_registered(c)
    with caplog.at_level(logging.DEBUG, "shoal.router.deployments.moves"):
        controller._reconcile(d, time.monotonic())
    assert d.state is DeploymentState.SERVING and d.rebalance_at == 0.0
    assert "would not improve its plan" in caplog.text


async def test_joins_within_the_quiet_period_give_one_judgement_after_the_last(
    model_path: Path, tmp_path: Path
) -> None:
    registry = Registry()
    for n in "ab":
        connect(registry, n, 200 * MIB)
    controller = await serving(model_path, registry, tmp_path, quiet_s=5.0)
    d = controller.items["split"]
    controller.on_registered(connect(registry, "c", 1000 * MIB))
    first = d.rebalance_at
    controller.on_registered(connect(registry, "d", 1000 * MIB))
    assert d.rebalance_at >= first
    controller._reconcile(d, d.rebalance_at - 0.1)
    assert d.state is DeploymentState.SERVING  # still quiet
    controller._reconcile(d, d.rebalance_at)
    assert d.state is not DeploymentState.SERVING  # judged once: better, and no answer runs
    assert [s.worker_id for s in d.shards] == ["a", "b", "c", "d"]


async def test_rebalance_on_demand_drains_a_serving_deployment(
    model_path: Path, tmp_path: Path
) -> None:
    registry = Registry()
    a, _ = (connect(registry, n, 200 * MIB) for n in "ab")
    controller = await serving(model_path, registry, tmp_path, quiet_s=3600.0)
    d = controller.items["split"]
    answering(a, "split")
    connect(registry, "c", 4096 * MIB)  # not told to the controller: the API asks instead
    controller.rebalance("split")
    assert d.state is DeploymentState.DRAINING and "rebalance requested" in d.detail
    controller.rebalance("split")  # asked again while it drains: nothing new
    assert d.state is DeploymentState.DRAINING


async def test_status_shows_each_stages_link(model_path: Path, tmp_path: Path) -> None:
    registry = Registry()
    for n in "ab":
        connect(registry, n, 200 * MIB)
    controller = await serving(model_path, registry, tmp_path)
    assert isinstance(controller.tunnels, FakeTunnels)
    controller.tunnels.stage_links["split"] = {
        "b": StageLink(TunnelBytes(1000, 200), (2_000_000, 1_000_000, 3_000_000), 1)
    }
    [view] = controller.status()
    head, stage = view["shards"]
    assert head["link"] is None
    link = stage["link"]
    assert link["measured"] and link["connections"] == 1
    assert (link["bytes_to_stage"], link["bytes_to_head"]) == (1000, 200)
    assert link["rtt_ms"] is None  # the head has not reported yet
    assert link["router_rtt_ms"] == {"median": 2.0, "p90": 3.0, "samples": 3}
    assert "tunnel hub" in link["router_rtt_measures"]

    # The head reports what it timed; another worker's report, or one of a stage it does
    # not head, changes nothing.
    a, b = (registry.get(WorkerId(n)) for n in "ab")
    assert a is not None and b is not None
    rtt = LinkRtt(worker_id=WorkerId("b"), median_ms=2.5, p90_ms=4.0, samples=40)
    controller.on_links(b, ShardLinks(deployment="split", stages=(rtt,)))
    controller.on_links(a, ShardLinks(deployment="other", stages=(rtt,)))
    assert controller.status()[0]["shards"][1]["link"]["rtt_ms"] is None
    controller.on_links(a, ShardLinks(deployment="split", stages=(rtt,)))
    link = controller.status()[0]["shards"][1]["link"]
    assert link["rtt_ms"] == {"median": 2.5, "p90": 4.0, "samples": 40}
    assert link["rtt_measures"].startswith("the head:")
    assert link["router_rtt_ms"]["samples"] == 3  # the hub's own figure, named apart


async def test_a_worker_that_registers_loading_joins_once_it_is_ready(
    model_path: Path, tmp_path: Path
) -> None:
    registry = Registry()
    for n in "ab":
        connect(registry, n, 200 * MIB)
    controller = await serving(model_path, registry, tmp_path)
    d = controller.items["split"]
    c = connect(registry, "c", 1000 * MIB)
    c.set_backend_state(BackendState.LOADING, "loading its model", None)
    controller.on_registered(c)
    controller._reconcile(d, time.monotonic())
    assert d.state is DeploymentState.SERVING and d.rebalance_at == 0.0  # not planned over yet
    c.set_backend_state(BackendState.READY, "", None)  # the registry tells the controller
    assert d.rebalance_at > 0.0
    controller._reconcile(d, time.monotonic())
    assert [s.worker_id for s in d.shards] == ["a", "b", "c"], (d.state, d.detail)


def test_a_link_says_why_it_is_not_measured() -> None:
    stage = ShardView("b", ShardRole.STAGE, 15, 29, 0, 0)
    assert link_json(stage, "direct", None) == {
        "measured": False,
        "why": "direct mode: the head dials the stage itself",
    }
    assert link_json(stage, "relayed", None) == {
        "measured": False,
        "why": "no tunnel open to this stage",
    }
    fresh = link_json(stage, "relayed", StageLink(TunnelBytes(), (), 1))
    assert fresh is not None and fresh["rtt_ms"] is None  # nothing asked of it yet
    assert fresh["router_rtt_ms"] is None


async def test_a_shard_worker_that_is_not_ready_now_is_not_planned_away(
    model_path: Path, tmp_path: Path
) -> None:
    """A worker of the plan whose own llama-server unloaded after idling is not "ready": a
    plan without it would look better (nobody over budget), but it still holds its shard."""
    registry = Registry()
    _, b = (connect(registry, n, 200 * MIB) for n in "ab")
    controller = await serving(model_path, registry, tmp_path)
    d = controller.items["split"]
    b.set_backend_state(BackendState.UNLOADED, "idle", None)
    controller.on_registered(connect(registry, "c", 1000 * MIB))
    controller._reconcile(d, time.monotonic())
    assert d.state is DeploymentState.SERVING
