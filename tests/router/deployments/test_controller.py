"""The deployments controller on its own: real registry and worker connections, no sockets;
the real default model's GGUF to plan from. Workers' answers are fed in as ``ShardStatus``."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from deployment_rig import (
    GIB,
    FakeTunnels,
    connect,
    deployed,
    router_pin,
    sent,
    specs,
    status,
)

from shoal.models.errors import ModelError
from shoal.models.gguf_info import inspect
from shoal.protocol.messages import (
    DevicePlacement,
    ModelFile,
    SeedReport,
    ShardDevice,
    ShardRole,
    ShardStart,
    ShardState,
    ShardStatus,
    ShardStop,
)
from shoal.router.deployments.controller import LOCATE_RETRY_S, Deployments
from shoal.router.deployments.deployment import (
    Deployment,
    DeploymentSpec,
    DeploymentState,
    TunnelBytes,
)
from shoal.router.deployments.nodes import planning_nodes
from shoal.router.deployments.placement import Strategy
from shoal.router.deployments.sources import Located, ModelSources
from shoal.router.dispatch.workers import Registry
from shoal.router.errors import BadRequest
from shoal.worker.shards.host import head_args
from socketless import worker_connection


class OneFile:
    """Sources where every model is one file: a catalog id as the router resolves it, without
    a catalog download (a stand-in for ``ModelSources``' catalog step, named so)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def locate(self, source: str) -> Located:
        return Located(source, inspect(self.path))


async def test_stages_first_then_the_head_with_the_plans_numbers(
    model_path: Path, tmp_path: Path
) -> None:
    registry = Registry()
    a, b, c = (connect(registry, n) for n in "abc")
    controller = await deployed(model_path, registry, tmp_path)
    d = controller.items["split"]
    assert d.state is DeploymentState.STARTING
    assert sent(a) == []  # the head waits for its stages
    for stage in (b, c):
        [start] = sent(stage)
        assert isinstance(start, ShardStart) and start.role is ShardRole.STAGE
    controller.on_shard(b, status(b, ShardRole.STAGE, ShardState.READY))
    assert sent(a) == []
    controller.on_shard(c, status(c, ShardRole.STAGE, ShardState.READY))
    [head] = sent(a)
    assert isinstance(head, ShardStart) and head.role is ShardRole.HEAD
    assert head.n_gpu_layers == 21 and head.tensor_split == (10.0, 11.0)
    assert [p.tunnel_id for p in head.peers] == ["t-b", "t-c"]
    controller.on_shard(a, status(a, ShardRole.HEAD, ShardState.READY))
    assert d.state is DeploymentState.SERVING and controller.unavailable("split") is None


async def test_a_stage_with_two_gpus_gets_its_layers_spread_over_both(
    model_path: Path, tmp_path: Path
) -> None:
    registry = Registry()
    a, b, c = (connect(registry, n) for n in "abc")
    b.shard_devices = (
        ShardDevice(name="CUDA0", free_bytes=24 * GIB),
        ShardDevice(name="CUDA1", free_bytes=8 * GIB),
    )
    controller = await deployed(model_path, registry, tmp_path)
    [b_start], [c_start] = sent(b), sent(c)
    assert isinstance(b_start, ShardStart) and isinstance(c_start, ShardStart)
    # Balanced over every device: a's RAM, b's two GPUs (its RAM only spills), c's RAM.
    assert (b_start.devices, b_start.layers) == (("CUDA0", "CUDA1"), (8, 22))
    assert (c_start.devices, c_start.layers) == (("CPU",), (23, 29))
    two_gpus = ShardStatus(
        deployment="split",
        role=ShardRole.STAGE,
        state=ShardState.READY,
        build="b1",
        devices=(24 * GIB, 8 * GIB),
    )
    controller.on_shard(b, two_gpus)
    controller.on_shard(c, status(c, ShardRole.STAGE, ShardState.READY))
    [head] = sent(a)
    assert isinstance(head, ShardStart)
    # a keeps 8 layers on its CPU; b's GPUs are RPC0 and RPC1, c's RAM RPC2 (+ the output).
    assert head.n_gpu_layers == 23 and head.devices == ("RPC0", "RPC1", "RPC2")
    assert head.tensor_split == (8.0, 7.0, 8.0)
    view = controller.status()[0]
    assert view["shards"][1]["device_free_bytes"] == [24 * GIB, 8 * GIB]
    assert view["layout"] == [
        "a/CPU layers 0-7 + token embedding",
        "b/CUDA0 layers 8-15",
        "b/CUDA1 layers 16-22",
        "c/CPU layers 23-29",
    ]
    assert [(d["device"], d["layers"]) for d in view["shards"][1]["devices"]] == [
        ("CUDA0", [8, 15]),
        ("CUDA1", [16, 22]),
    ]


async def test_a_gpu_head_puts_the_first_layers_on_its_gpu(
    model_path: Path, tmp_path: Path
) -> None:
    """The head's GPU takes layers: its command line names it before the stages' devices,
    and what the head reports it placed is shown as whose device holds what."""
    registry = Registry()
    a, b, c = (connect(registry, n) for n in "abc")
    a.shard_devices = (ShardDevice(name="CUDA0", free_bytes=80 * GIB),)
    c.shard_devices = (ShardDevice(name="CUDA0", free_bytes=80 * GIB),)
    controller = await deployed(model_path, registry, tmp_path)
    [b_start], [c_start] = sent(b), sent(c)
    assert isinstance(b_start, ShardStart) and isinstance(c_start, ShardStart)
    assert (b_start.devices, c_start.devices) == (("CPU",), ("CUDA0",))
    for w in (b, c):
        controller.on_shard(w, status(w, ShardRole.STAGE, ShardState.READY))
    [head] = sent(a)
    assert isinstance(head, ShardStart)
    assert head.n_gpu_layers == 31 and head.devices == ("CUDA0", "RPC0", "RPC1")
    assert head.tensor_split == (10.0, 10.0, 11.0)
    argv = head_args(["127.0.0.1:5001", "127.0.0.1:5002"], head)
    assert argv[argv.index("--device") + 1] == "CUDA0,RPC0,RPC1"
    assert argv[argv.index("--tensor-split") + 1] == "10,10,11"
    assert argv[argv.index("--n-gpu-layers") + 1] == "31"
    assert argv.index("--rpc") < argv.index("--device")  # llama-server resolves names in order
    mib = 2**20
    placed = tuple(
        DevicePlacement(device=name, model_bytes=m * mib, kv_bytes=k * mib)
        for name, m, k in (("CPU", 50, 0), ("CUDA0", 30, 10), ("RPC0", 30, 10), ("RPC1", 31, 10))
    )
    ready = status(a, ShardRole.HEAD, ShardState.READY).model_copy(update={"placement": placed})
    controller.on_shard(a, ready)
    view = controller.status()[0]
    assert view["state"] == "serving"
    assert "a/CUDA0 30.0 MiB" in view["detail"] and "c/CUDA0 31.0 MiB" in view["detail"]
    by_device = {p["device"]: p for p in view["shards"][0]["placement"]}
    assert by_device["CPU"]["planned_layers"] is None  # the token embedding only
    assert (by_device["CUDA0"]["worker"], by_device["CUDA0"]["planned_layers"]) == ("a", [0, 9])
    assert (by_device["RPC1"]["worker"], by_device["RPC1"]["worker_device"]) == ("c", "CUDA0")
    assert by_device["RPC1"]["planned_layers"] == [20, 29]


async def test_a_build_mismatch_is_refused_naming_both_builds(
    model_path: Path, tmp_path: Path
) -> None:
    registry = Registry()
    a, b, c = (connect(registry, n) for n in "abc")
    controller = await deployed(model_path, registry, tmp_path)
    controller.on_shard(b, status(b, ShardRole.STAGE, ShardState.READY, build="b11434"))
    controller.on_shard(c, status(c, ShardRole.STAGE, ShardState.READY, build="b11500"))
    d = controller.items["split"]
    assert d.state is DeploymentState.DEGRADED
    assert "b11434" in d.detail and "b11500" in d.detail and "same Shoal version" in d.detail
    assert all(isinstance(m, ShardStop) for w in (b, c) for m in sent(w)[-1:])
    why = controller.unavailable("split")
    assert why is not None and "degraded" in why


async def started_again(controller: Deployments, d: Deployment) -> None:
    """Run the controller until ``d``, degraded, is starting again (its backoff passed)."""
    d.retry_at = 0.0
    task = asyncio.create_task(controller.run())
    try:
        async with asyncio.timeout(5):
            while d.state is not DeploymentState.STARTING:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()


async def test_a_worker_leaving_degrades_and_a_smaller_plan_follows(
    model_path: Path, tmp_path: Path
) -> None:
    registry = Registry()
    a, b, c = (connect(registry, n) for n in "abc")
    controller = Deployments(
        registry, specs(tmp_path), FakeTunnels(), ModelSources(model_path.parent), pin=router_pin
    )
    spec = DeploymentSpec("split", str(model_path), 1024, Strategy.BALANCED, None, "relayed")
    await controller.deploy(spec)
    for w in (b, c):
        controller.on_shard(w, status(w, ShardRole.STAGE, ShardState.READY))
    controller.on_shard(a, status(a, ShardRole.HEAD, ShardState.READY))
    registry.remove(c)
    controller.on_lost(c)
    d = controller.items["split"]
    assert d.state is DeploymentState.DEGRADED and "left" in d.detail
    await started_again(controller, d)
    assert [s.worker_id for s in d.shards] == ["a", "b"]
    assert [(s.first_layer, s.last_layer) for s in d.shards] == [(0, 14), (15, 29)]


async def test_no_fit_is_pending_with_the_shortfall(model_path: Path, tmp_path: Path) -> None:
    registry = Registry()
    for name in "abc":
        connect(registry, name, ram=64 * 2**20)
    controller = await deployed(model_path, registry, tmp_path)
    d = controller.items["split"]
    assert d.state is DeploymentState.PENDING
    assert "short" in d.detail or "need" in d.detail, d.detail


CANNOT = "cannot run split models here: llama.cpp does not list the device(s) CUDA2"


async def test_workers_that_cannot_run_shards_are_left_out_or_named(
    model_path: Path, tmp_path: Path
) -> None:
    registry = Registry()
    a, b, c = (connect(registry, n) for n in "abc")
    c.no_shards = CANNOT
    controller = Deployments(
        registry, specs(tmp_path), FakeTunnels(), ModelSources(model_path.parent), pin=router_pin
    )
    spec = DeploymentSpec("any", str(model_path), 1024, Strategy.BALANCED, None, "relayed")
    await controller.deploy(spec)
    assert [s.worker_id for s in controller.items["any"].shards] == ["a", "b"]
    named = DeploymentSpec("named", str(model_path), 1024, Strategy.BALANCED, ("a", "c"), "relayed")
    await controller.deploy(named)
    d = controller.items["named"]
    assert d.state is DeploymentState.PENDING and d.detail == f"c: {CANNOT}"

    assert [n.id for n in planning_nodes(registry, None)] == ["a", "b"]
    with pytest.raises(BadRequest, match="c: cannot run split models here"):
        planning_nodes(registry, ["a", "c"])
    a.no_shards = b.no_shards = CANNOT
    with pytest.raises(BadRequest, match="No connected worker can run parts of split models"):
        planning_nodes(registry, None)


async def test_workers_named_by_name_or_id_and_what_cannot_be_planned(
    model_path: Path, tmp_path: Path
) -> None:
    """Stored deployments name workers as the user did: a name shared by two workers, or a
    worker named twice, keeps the deployment pending with the reason (the planner refused a
    worker named twice with a ValueError before)."""
    registry = Registry()
    for worker_id, name in (("a-1", "a"), ("b-1", "b"), ("b-2", "b")):
        registry.add(worker_connection(name, ram_bytes=8 * GIB, worker_id=worker_id))
    controller = Deployments(
        registry, specs(tmp_path), FakeTunnels(), ModelSources(model_path.parent), pin=router_pin
    )

    def spec(name: str, workers: tuple[str, ...]) -> DeploymentSpec:
        return DeploymentSpec(name, str(model_path), 1024, Strategy.BALANCED, workers, "relayed")

    await controller.deploy(spec("by-name", ("a", "b-2")))
    assert [s.worker_id for s in controller.items["by-name"].shards] == ["a-1", "b-2"]
    view = controller.status()[0]["shards"]
    assert [(s["worker"], s["worker_name"]) for s in view] == [("a-1", "a"), ("b-2", "b")]
    await controller.deploy(spec("shared", ("a", "b")))
    shared = controller.items["shared"]
    assert shared.state is DeploymentState.PENDING
    assert "named 'b': b-1, b-2; name the one you mean by its id" in shared.detail
    await controller.deploy(spec("twice", ("a", "a-1")))
    twice = controller.items["twice"]
    assert twice.state is DeploymentState.PENDING and "more than once" in twice.detail
    await controller.deploy(spec("later", ("a", "c")))
    assert controller.items["later"].detail == "waiting for worker(s) c"

    assert [n.id for n in planning_nodes(registry, ["b-1", "a"])] == ["b-1", "a-1"]
    with pytest.raises(BadRequest, match="b-1, b-2"):
        planning_nodes(registry, ["a", "b"])
    with pytest.raises(BadRequest, match=r"connected: a \(a-1\), b \(b-1\), b \(b-2\)"):
        planning_nodes(registry, ["a", "c"])


async def test_a_worker_named_by_name_that_restarts_with_a_new_id_is_used_again(
    model_path: Path, tmp_path: Path
) -> None:
    """A worker process that restarts registers with a new id (``new_worker_id``): a
    deployment that named it by ``--name`` is planned over it again."""
    registry = Registry()
    a, b = (worker_connection(n, ram_bytes=8 * GIB, worker_id=f"{n}-1") for n in "ab")
    registry.add(a), registry.add(b)
    controller = Deployments(
        registry, specs(tmp_path), FakeTunnels(), ModelSources(model_path.parent), pin=router_pin
    )
    spec = DeploymentSpec("split", str(model_path), 1024, Strategy.BALANCED, ("a", "b"), "relayed")
    await controller.deploy(spec)
    d = controller.items["split"]
    registry.remove(b)
    controller.on_lost(b)
    assert d.state is DeploymentState.DEGRADED
    restarted = worker_connection("b", ram_bytes=8 * GIB, worker_id="b-2")
    registry.add(restarted)
    controller.on_registered(restarted)
    await started_again(controller, d)
    assert [s.worker_id for s in d.shards] == ["a-1", "b-2"]


async def test_stages_learn_their_layers_and_the_view_shows_seeding_and_deploy_cost(
    model_path: Path, tmp_path: Path
) -> None:
    registry = Registry()
    a, b, c = (connect(registry, n) for n in "abc")
    controller = await deployed(model_path, registry, tmp_path)
    assert isinstance(controller.tunnels, FakeTunnels)
    starts = [sent(w)[0] for w in (b, c)]
    assert all(isinstance(s, ShardStart) for s in starts)
    assert [(s.layers, s.output) for s in starts if isinstance(s, ShardStart)] == [
        ((10, 19), False),
        ((20, 29), True),  # the last stage holds the output layer too
    ]
    seeded = SeedReport(tensors=4, bytes=48 * 2**20, cached=1, seconds=0.25, source="local")
    ready = status(b, ShardRole.STAGE, ShardState.READY).model_copy(update={"seed": seeded})
    controller.on_shard(b, ready)
    controller.on_shard(c, status(c, ShardRole.STAGE, ShardState.READY))
    controller.tunnels.carried["split"] = TunnelBytes(to_stages=5000, to_head=700)
    controller.on_shard(a, status(a, ShardRole.HEAD, ShardState.READY))
    view = controller.status()[0]
    assert view["shards"][1]["seed"] == seeded.model_dump()
    assert view["shards"][2]["seed"] is None  # c did not pre-seed (no cache there)
    assert view["last_deploy"]["tunnel_bytes"] == {"to_stages": 5000, "to_head": 700}
    assert view["last_deploy"]["seconds"] >= 0
    controller.tunnels.carried["split"] = TunnelBytes(to_stages=9000, to_head=900)
    view = controller.status()[0]
    assert view["tunnel_bytes"] == {"to_stages": 9000, "to_head": 900}  # tokens since then
    assert view["last_deploy"]["tunnel_bytes"]["to_stages"] == 5000  # the deploy's own


PINNED = ModelFile(
    source="llama-3.3-70b-instruct",
    kind="hub",
    quantization="Q2_K",
    repo="bartowski/Llama-3.3-70B-Instruct-GGUF",
    filename="Llama-3.3-70B-Instruct-Q2_K.gguf",
    revision="c0ffee" * 6 + "abcd",
    size=123,
)


async def test_head_and_stages_are_told_the_one_file_the_router_pinned(
    model_path: Path, tmp_path: Path
) -> None:
    registry = Registry()
    a, b, c = (connect(registry, n) for n in "abc")
    pins: list[str] = []

    def pin(source: str) -> ModelFile:
        pins.append(source)
        return PINNED

    controller = Deployments(registry, specs(tmp_path), FakeTunnels(), OneFile(model_path), pin=pin)
    spec = DeploymentSpec(
        "big", "llama-3.3-70b-instruct", 1024, Strategy.BALANCED, ("a", "b", "c"), "relayed"
    )
    await controller.deploy(spec)
    starts = [m for w in (b, c) for m in sent(w)]
    for w in (b, c):
        controller.on_shard(
            w,
            ShardStatus(deployment="big", role=ShardRole.STAGE, state=ShardState.READY, build="b1"),
        )
    starts += sent(a)
    assert [type(m) for m in starts] == [ShardStart] * 3
    assert {m.file for m in starts if isinstance(m, ShardStart)} == {PINNED}
    assert pins == ["llama-3.3-70b-instruct"]  # once per attempt, at plan time
    assert controller.status()[0]["file"] == PINNED.model_dump()


async def test_a_file_that_cannot_be_pinned_leaves_the_deployment_pending(
    model_path: Path, tmp_path: Path
) -> None:
    registry = Registry()
    b = connect(registry, "b")
    connect(registry, "a")

    def pin(source: str) -> ModelFile:
        raise ModelError("gone from the cache")

    controller = Deployments(registry, specs(tmp_path), FakeTunnels(), OneFile(model_path), pin=pin)
    spec = DeploymentSpec("big", "x", 1024, Strategy.BALANCED, ("a", "b"), "relayed")
    await controller.deploy(spec)
    d = controller.items["big"]
    assert d.state is DeploymentState.PENDING and "gone from the cache" in d.detail
    assert sent(b) == []


async def test_rebalance_redeploys_when_only_the_devices_change(
    model_path: Path, tmp_path: Path
) -> None:
    registry = Registry()
    a, b, c = (connect(registry, n) for n in "abc")
    b.shard_devices = (ShardDevice(name="CUDA0", free_bytes=8 * GIB),)
    controller = await deployed(model_path, registry, tmp_path)
    d = controller.items["split"]
    assert d.plan is not None and d.plan.shards[1].holders[0].device == "CUDA0"
    assert d.state is DeploymentState.STARTING
    controller.rebalance("split")
    assert d.state is DeploymentState.STARTING  # nothing changed: left alone
    b.shard_devices = (ShardDevice(name="CUDA1", free_bytes=8 * GIB),)  # same memory, other GPU
    controller.rebalance("split")
    assert d.state is DeploymentState.PENDING and d.detail == "rebalancing"
    assert [m for m in sent(b) if isinstance(m, ShardStop)]


async def test_a_model_gone_when_planned_again_is_looked_for_again_later(
    model_path: Path, tmp_path: Path
) -> None:
    """Every attempt finds the model afresh (``sources``): one gone (a file deleted, a store
    down) leaves the deployment pending, saying why, and looked for again after a while."""
    copy = tmp_path / "moving.gguf"
    os.link(model_path, copy)
    registry = Registry()
    a, b = (connect(registry, n) for n in "ab")
    controller = Deployments(
        registry, specs(tmp_path), FakeTunnels(), ModelSources(tmp_path), pin=router_pin
    )
    spec = DeploymentSpec("moving", str(copy), 1024, Strategy.BALANCED, None, "relayed")
    await controller.deploy(spec)
    d = controller.items["moving"]
    assert d.state is DeploymentState.STARTING
    copy.unlink()
    registry.remove(b)
    controller.on_lost(b)
    d.retry_at = 0.0
    task = asyncio.create_task(controller.run())
    try:
        async with asyncio.timeout(5):
            while d.state is not DeploymentState.PENDING:
                await asyncio.sleep(0.01)
        assert "cannot read" in d.detail and "moving.gguf" in d.detail
        assert d.retry_at > time.monotonic() + LOCATE_RETRY_S / 2  # not at every event
        assert "moving" not in controller.located
    finally:
        task.cancel()
    os.link(model_path, copy)
    await started_again(controller, d)
    assert [s.worker_id for s in d.shards] == ["a"]
