"""The command lines of a worker's shards: what a head's llama-server and a stage's
ggml-rpc-server are started with, from the router's ``ShardStart``."""

from __future__ import annotations

import pytest

from shoal.llama_cpp.devices import ComputeDevice
from shoal.protocol.ids import ModelName, WorkerId
from shoal.protocol.messages import ShardRole, ShardStart
from shoal.worker.shards.host import head_args, served_devices
from shoal.worker.shards.tunnels import link_report

GIB = 2**30
CUDA = (ComputeDevice("CUDA0", "H100", 80 * GIB, 79 * GIB),)


def start(role: ShardRole, **fields: object) -> ShardStart:
    return ShardStart(
        deployment="d", role=role, model=ModelName("m"), source="m.gguf", ctx_size=1024
    ).model_copy(update=fields)


def test_a_gpu_head_offloads_to_its_gpu_first() -> None:
    spec = start(
        ShardRole.HEAD, n_gpu_layers=31, devices=("CUDA0", "RPC0"), tensor_split=(15.0, 16.0)
    )
    assert head_args(["127.0.0.1:50052"], spec)[:8] == (
        "--rpc", "127.0.0.1:50052", "--n-gpu-layers", "31",
        "--device", "CUDA0,RPC0", "--tensor-split", "15,16",
    )  # fmt: skip


def test_a_cpu_head_keeps_its_layers_and_names_only_the_stages() -> None:
    spec = start(ShardRole.HEAD, n_gpu_layers=21, devices=("RPC0", "RPC1"), tensor_split=(10, 11))
    argv = head_args(["127.0.0.1:1", "127.0.0.1:2"], spec)
    assert argv[:8] == (
        "--rpc", "127.0.0.1:1,127.0.0.1:2", "--n-gpu-layers", "21",
        "--device", "RPC0,RPC1", "--tensor-split", "10,11",
    )  # fmt: skip
    assert argv[8:] == ("--fit", "off", "--cache-ram", "0", "-lv", "4")


def test_a_head_alone_offloads_nothing_it_was_not_given() -> None:
    argv = head_args([], start(ShardRole.HEAD))
    assert argv[:4] == ("--n-gpu-layers", "0", "--device", "none") and "--rpc" not in argv


def test_a_stage_serves_the_devices_it_is_told() -> None:
    assert served_devices(("CPU", "CUDA0"), CUDA) == ("CPU", "CUDA0")
    assert served_devices(("CUDA0",), CUDA) == ("CUDA0",)
    assert served_devices(("CPU",), ()) == ("CPU",)
    assert served_devices((), CUDA) == ("CUDA0",)  # none named: every GPU listed
    assert served_devices((), ()) == ()  # ... or ggml-rpc-server's default, the CPU
    with pytest.raises(RuntimeError, match="planned layers on CUDA1.*it lists: CUDA0"):
        served_devices(("CUDA1",), CUDA)


def test_a_head_reports_its_stages_round_trips_only_when_a_stage_answered_anew() -> None:
    b, c = WorkerId("b"), WorkerId("c")
    assert link_report("split", {b: (), c: ()}, {}) is None  # nothing asked of them yet
    now = {b: (1_000_000, 3_000_000), c: ()}
    report = link_report("split", now, {})
    assert report is not None and report.deployment == "split"
    [rtt] = report.stages  # c answered nothing: no figure for it
    assert (rtt.worker_id, rtt.median_ms, rtt.p90_ms, rtt.samples) == (b, 2.0, 3.0, 2)
    assert link_report("split", now, now) is None  # nothing new since the last report
    later = {b: now[b], c: (500_000,)}
    again = link_report("split", later, now)
    assert again is not None and [r.worker_id for r in again.stages] == [b, c]
