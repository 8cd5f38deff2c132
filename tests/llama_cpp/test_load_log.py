"""Reading the placement out of llama-server's load log (lines recorded from the pinned build)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.llama_cpp.load_log import MIB, placement

# llama-server -ngl 21 -ts 1,1 --rpc 127.0.0.1:50161,127.0.0.1:50162 -lv 4 (b11434): note the
# second server is labelled RPC0 too; its address tells them apart.
RECORDED = (Path(__file__).parent / "data" / "llama_server_rpc_load.log").read_text().splitlines()
RPC = ["127.0.0.1:50161", "127.0.0.1:50162"]


def test_devices_in_rpc_order_with_their_buffers() -> None:
    got = placement(RECORDED, RPC)
    assert [(d.device, d.address) for d in got] == [
        ("CPU", None),
        ("RPC0", "127.0.0.1:50161"),
        ("RPC1", "127.0.0.1:50162"),
    ]
    assert [d.kv_bytes for d in got] == [15 * MIB, int(16.5 * MIB), int(13.5 * MIB)]
    assert got[1].model_bytes == round(23.25 * MIB) and got[0].model_bytes == round(92.10 * MIB)


def test_a_stage_llama_server_went_on_without_is_an_error() -> None:
    without_second = [line for line in RECORDED if "using device RPC1" not in line]
    with pytest.raises(ValueError, match="127.0.0.1:50162"):
        placement(without_second, RPC)


# Recorded on an H100 (b11434 built with -DGGML_CUDA=ON), a 30-layer model, -c 1024:
# llama-server --rpc 127.0.0.1:50070 -ngl 31 --device CUDA0,RPC0 -ts 15,16 beside
# ggml-rpc-server -d CUDA0 (the head's GPU first, then the stage's) ...
DATA = Path(__file__).parent / "data"
GPU_HEAD = (DATA / "llama_server_cuda_head_load.log").read_text().splitlines()
# ... and -ngl 28 --device CUDA0,RPC0,RPC1,RPC2 -ts 7,5,5,11 over ggml-rpc-server -d CPU,CUDA0
# (port 50080: RPC0 its RAM, RPC1 its GPU) and ggml-rpc-server -d CUDA0 (50081: RPC2).
SPILL = (DATA / "llama_server_cuda_spill_load.log").read_text().splitlines()


def test_the_heads_own_gpu_is_a_device_of_its_own() -> None:
    got = placement(GPU_HEAD, ["127.0.0.1:50070"])
    assert [(d.device, d.address) for d in got] == [
        ("CPU", None),
        ("CUDA0", None),
        ("RPC0", "127.0.0.1:50070"),
    ]
    assert [d.kv_bytes for d in got] == [0, round(11.25 * MIB), round(11.25 * MIB)]
    assert [d.model_bytes for d in got] == [round(x * MIB) for x in (28.69, 31.74, 60.43)]
    # The head's RAM computes too: CUDA_Host is pinned host memory.
    assert [d.compute_bytes for d in got] == [round(x * MIB) for x in (19.32, 45.18, 35.04)]


def test_a_servers_second_device_is_told_apart_by_its_index_there() -> None:
    got = placement(SPILL, ["127.0.0.1:50080", "127.0.0.1:50081"])
    assert [(d.device, d.address) for d in got] == [
        ("CPU", None),
        ("CUDA0", None),
        ("RPC0", "127.0.0.1:50080"),
        ("RPC1", "127.0.0.1:50080"),
        ("RPC2", "127.0.0.1:50081"),
    ]
    assert [d.kv_bytes for d in got] == [round(x * MIB) for x in (2.25, 5.25, 3.75, 3.75, 7.5)]
    assert [d.model_bytes for d in got] == [
        round(x * MIB) for x in (56.17, 14.81, 10.57, 10.58, 49.85)
    ]
