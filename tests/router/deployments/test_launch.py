"""The head's -ngl/--tensor-split, checked against llama.cpp's own layer assignment."""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.llama_cpp.load_log import placement
from shoal.protocol.ids import ModelName
from shoal.protocol.messages import ShardRole, ShardStart
from shoal.router.deployments.launch import (
    HeadLaunch,
    Holder,
    head_launch,
    holders,
    placed_layers,
    stage_devices,
    too_many_devices,
)
from shoal.router.deployments.placement import DeviceShare, Plan, Shard, Strategy
from shoal.worker.shards.host import offload_args


def llama_cpp_devices(n_layer: int, ngl: int, tensor_split: tuple[int, ...]) -> list[int]:
    """Where llama.cpp (``llama_model::load_tensors``) puts each layer, the output layer
    (index ``n_layer``) included: -1 for the CPU, else the RPC device index. Same float32
    arithmetic as the C++: cumulative split proportions and ``float(il - start) / act``."""
    start = max(n_layer + 1 - ngl, 0)
    act = min(ngl, n_layer + 1)
    splits = np.cumsum(np.array(tensor_split, dtype=np.float32), dtype=np.float32)
    splits = (splits / splits[-1]).astype(np.float32).tolist()
    out = []
    for il in range(n_layer + 1):
        if il < start or il - start >= act:
            out.append(-1)
        else:
            x = float(np.float32(il - start) / np.float32(act))
            out.append(bisect.bisect_right(splits, x))
    return out


def plan_of(counts: list[int]) -> Plan:
    shards, first = [], 0
    for i, n in enumerate(counts):
        role = "head" if i == 0 else ("tail" if i == len(counts) - 1 else "stage")
        held = (first, first + n - 1, 0, 0, 0, 0, 0, 0)
        shards.append(Shard(*held, node_id=f"w{i}", role=role))  # type: ignore[arg-type]
        first += n
    return Plan(tuple(shards), ctx=1024, strategy=Strategy.BALANCED)


@given(st.lists(st.integers(1, 60), min_size=1, max_size=6))
def test_every_layer_lands_where_the_plan_says(counts: list[int]) -> None:
    launch = head_launch(plan_of(counts))
    n_layer = sum(counts)
    if len(counts) == 1:
        assert launch.n_gpu_layers == 0 and launch.tensor_split == ()
        return
    devices = llama_cpp_devices(n_layer, launch.n_gpu_layers, launch.tensor_split)
    expected = [-1] * counts[0]
    for index, n in enumerate(counts[1:]):
        expected += [index] * n
    expected.append(len(counts) - 2)  # the output layer, with the last stage
    assert devices == expected


def plan_with(shards: list[list[tuple[str, int]]]) -> Plan:
    """A plan whose shards hold ``(device, layers)`` each, in order; the head's CPU may hold
    none (the token embedding only)."""
    out, first = [], 0
    for i, devices in enumerate(shards):
        role = "head" if i == 0 else ("tail" if i == len(shards) - 1 else "stage")
        shares, start = [], first
        for device, n in devices:
            shares.append(DeviceShare(first, first + n - 1, 0, 0, 0, 0, 0, 0, device=device))
            first += n
        held = (start, first - 1, 0, 0, 0, 0, 0, 0)
        out.append(Shard(*held, node_id=f"w{i}", role=role, devices=tuple(shares)))  # type: ignore[arg-type]
    return Plan(tuple(out), ctx=1024, strategy=Strategy.BALANCED)


def args(launch: HeadLaunch) -> tuple[str, ...]:
    """The head's offload arguments as its worker writes them from the router's ShardStart."""
    start = ShardStart(
        deployment="d",
        role=ShardRole.HEAD,
        model=ModelName("m"),
        source="m.gguf",
        ctx_size=1024,
        n_gpu_layers=launch.n_gpu_layers,
        devices=launch.devices,
        tensor_split=tuple(float(x) for x in launch.tensor_split),
    )
    return offload_args(start)


@st.composite
def device_plans(draw: st.DrawFn) -> list[list[tuple[str, int]]]:
    """A head with its RAM (maybe no layers) and 0-2 GPUs, then 0-3 stages of 1-3 devices."""
    layers = st.integers(1, 40)
    head = [("CPU", draw(st.integers(0, 40)))]
    head += [(f"CUDA{k}", draw(layers)) for k in range(draw(st.integers(0, 2)))]
    if sum(n for _, n in head) == 0:
        head[0] = ("CPU", 1)
    stages = [
        [
            (name, draw(layers))
            for name in draw(
                st.sampled_from([["CPU"], ["CUDA0"], ["CPU", "CUDA0"], ["CUDA0", "CUDA1", "CUDA2"]])
            )
        ]
        for _ in range(draw(st.integers(0, 3)))
    ]
    return [head, *stages]


@given(device_plans())
def test_every_layer_lands_on_the_planned_device_of_the_planned_worker(
    shards: list[list[tuple[str, int]]],
) -> None:
    plan = plan_with(shards)
    launch = head_launch(plan)
    assert launch.n_gpu_layers == sum(launch.tensor_split)
    assert len(launch.devices) == len(launch.tensor_split)
    n_layer = sum(n for devices in shards for _, n in devices)
    expected = [
        (f"w{i}", device)
        for i, devices in enumerate(shards)
        for device, n in devices
        for _ in range(n)
    ]
    who = holders(plan)
    placed = llama_cpp_devices(n_layer, launch.n_gpu_layers, launch.tensor_split or (1,))
    got = [who["CPU" if k < 0 else launch.devices[k]] for k in placed]
    assert [(h.worker, h.device) for h in got[:-1]] == expected
    assert (got[-1].worker, got[-1].device) == expected[-1]  # the output layer, with the last
    assert stage_devices(plan) == tuple(tuple(d for d, _ in devices) for devices in shards[1:])
    rpc = [d for d in launch.devices if d.startswith("RPC")]
    assert rpc == [f"RPC{k}" for k in range(sum(len(s) for s in shards[1:]))]


def test_a_gpu_head_and_a_gpu_stage() -> None:
    """The H100 check's command line: the head's GPU takes the first layers."""
    launch = head_launch(plan_with([[("CPU", 0), ("CUDA0", 15)], [("CUDA0", 15)]]))
    assert args(launch) == (
        "--n-gpu-layers", "31", "--device", "CUDA0,RPC0", "--tensor-split", "15,16",
    )  # fmt: skip


def test_spilling_on_both_sides() -> None:
    """The head's RAM holds its first 4 layers (left behind by -ngl); the stage serves its RAM,
    then its GPU."""
    plan = plan_with([[("CPU", 4), ("CUDA0", 10)], [("CPU", 2), ("CUDA0", 14)]])
    assert args(head_launch(plan)) == (
        "--n-gpu-layers", "27", "--device", "CUDA0,RPC0,RPC1", "--tensor-split", "10,2,15",
    )  # fmt: skip
    assert stage_devices(plan) == (("CPU", "CUDA0"),)
    who = holders(plan)
    assert who["RPC0"] == Holder("w1", "CPU", (14, 15))
    assert who["RPC1"] == Holder("w1", "CUDA0", (16, 29))


def test_one_shard() -> None:
    assert args(head_launch(plan_of([30]))) == ("--n-gpu-layers", "0", "--device", "none")
    gpu = head_launch(plan_with([[("CPU", 0), ("CUDA0", 30)]]))
    assert args(gpu) == ("--n-gpu-layers", "31", "--device", "CUDA0", "--tensor-split", "31")
    assert holders(plan_with([[("CPU", 0), ("CUDA0", 30)]]))["CPU"].layers is None


def test_the_default_model_over_three_workers() -> None:
    launch = head_launch(plan_of([10, 10, 10]))
    assert launch.n_gpu_layers == 21 and launch.tensor_split == (10, 11)
    assert launch.devices == ("RPC0", "RPC1")  # the CPU head: its layers stay in its RAM


def test_layers_read_back_from_kv_buffers() -> None:
    per_layer = 1536 * 1024  # 1.5 MiB, as llama-server logs it for 2048 cells
    assert placed_layers([15 * 2**20, int(16.5 * 2**20), int(13.5 * 2**20)], per_layer) == (
        10,
        11,
        9,
    )


def test_llama_server_takes_at_most_15_devices() -> None:
    assert too_many_devices(plan_with([[("CPU", 1)], *[[("CUDA0", 1)]] * 15])) is None
    why = too_many_devices(plan_with([[("CPU", 1)], *[[("CUDA0", 1)]] * 16]))
    assert why is not None and "16 devices" in why and "at most 15" in why


LOGS = Path(__file__).parents[2] / "llama_cpp" / "data"


@pytest.mark.parametrize(
    ("log", "shards", "rpc", "argv", "stages"),
    [
        (
            "llama_server_cuda_head_load.log",
            [[("CPU", 0), ("CUDA0", 15)], [("CUDA0", 15)]],
            ["127.0.0.1:50070"],
            "--n-gpu-layers 31 --device CUDA0,RPC0 --tensor-split 15,16",
            (("CUDA0",),),
        ),
        (
            "llama_server_cuda_spill_load.log",
            [[("CPU", 3), ("CUDA0", 7)], [("CPU", 5), ("CUDA0", 5)], [("CUDA0", 10)]],
            ["127.0.0.1:50080", "127.0.0.1:50081"],
            "--n-gpu-layers 28 --device CUDA0,RPC0,RPC1,RPC2 --tensor-split 7,5,5,11",
            (("CPU", "CUDA0"), ("CUDA0",)),
        ),
    ],
)
def test_what_llama_server_placed_on_an_h100_is_the_plan(
    log: str,
    shards: list[list[tuple[str, int]]],
    rpc: list[str],
    argv: str,
    stages: tuple[tuple[str, ...], ...],
) -> None:
    """These plans' arguments (``argv`` for the head, ``-d`` per stage), run on an H100
    (llama.cpp b11434 with CUDA): the KV buffer each device reported holds exactly the
    layers the plan gave that worker's device."""
    plan = plan_with(shards)
    assert " ".join(args(head_launch(plan))) == argv
    assert stage_devices(plan) == stages
    loads = placement((LOGS / log).read_text().splitlines(), rpc)
    layers = placed_layers([d.kv_bytes for d in loads], 768 * 1024)  # 0.75 MiB at -c 1024
    who = holders(plan)
    got = {
        (who[d.device].worker, who[d.device].device): n for d, n in zip(loads, layers, strict=True)
    }
    expected = {(f"w{i}", device): n for i, devices in enumerate(shards) for device, n in devices}
    assert got == expected
