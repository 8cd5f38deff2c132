"""The planner's nodes for workers: the RAM and the GPUs each offers, head and stages alike."""

from __future__ import annotations

from shoal.protocol.messages import ShardDevice
from shoal.router.deployments.nodes import shard_nodes
from shoal.router.deployments.placement import Gpu
from socketless import worker_connection

GIB = 2**30


def test_every_worker_offers_its_ram_and_its_gpus() -> None:
    head = worker_connection("a", ram_bytes=8 * GIB)
    head.shard_devices = (ShardDevice(name="CUDA0", free_bytes=24 * GIB),)  # the head's GPU too
    gpu_stage = worker_connection("b", ram_bytes=8 * GIB)
    gpu_stage.shard_devices = (
        ShardDevice(name="CUDA0", free_bytes=20 * GIB),
        ShardDevice(name="CUDA1", free_bytes=4 * GIB),
    )
    cpu_stage = worker_connection("c", ram_bytes=6 * GIB)
    nodes = shard_nodes([head, gpu_stage, cpu_stage])
    assert [(n.id, n.free_bytes, n.gpus) for n in nodes] == [
        ("a", 8 * GIB, (Gpu("CUDA0", 24 * GIB),)),
        ("b", 8 * GIB, (Gpu("CUDA0", 20 * GIB), Gpu("CUDA1", 4 * GIB))),
        ("c", 6 * GIB, ()),
    ]


def test_unified_memory_is_not_offered_twice() -> None:
    mac = worker_connection("m", ram_bytes=48 * GIB)
    mac.shard_devices = (ShardDevice(name="MTL0", free_bytes=40 * GIB, unified_memory=True),)
    [node] = shard_nodes([mac])
    assert (node.free_bytes, node.gpus) == (8 * GIB, (Gpu("MTL0", 40 * GIB),))


def test_shard_ram_caps_the_ram_a_worker_offers() -> None:
    capped = worker_connection("s", ram_bytes=8 * GIB)
    capped.shard_ram_bytes = 2 * GIB  # --shard-ram 2
    roomy = worker_connection("r", ram_bytes=1 * GIB)
    roomy.shard_ram_bytes = 2 * GIB  # a cap above what is free changes nothing
    assert [n.free_bytes for n in shard_nodes([capped, roomy])] == [2 * GIB, 1 * GIB]
