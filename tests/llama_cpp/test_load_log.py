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
