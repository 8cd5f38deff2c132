"""``worker/text/residency/measured.py``: what a loaded model holds, from llama-server's own
buffer lines. A table of lines as llama.cpp writes them, then the real llama-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shoal.llama_cpp.load_log import MIB
from shoal.models.gguf_info import inspect_cached
from shoal.models.residency import Footprint
from shoal.protocol.messages import BackendState
from shoal.worker.text.llama_server import LlamaServer, LlamaServerConfig
from shoal.worker.text.residency.budget import estimate
from shoal.worker.text.residency.measured import footprint_from_log, last_load

USING = "llama_prepare_model_devices: using device {} (NVIDIA H100) (0000:{}) - 80000 MiB free\n"
CUDA_TWO_GPUS = (
    USING.format("CUDA0", "01")
    + USING.format("CUDA1", "02")
    + """\
load_tensors: offloaded 33/33 layers to GPU
load_tensors:        CUDA0 model buffer size =  2201.00 MiB
load_tensors:        CUDA1 model buffer size =  2202.00 MiB
load_tensors:   CPU_Mapped model buffer size =   281.00 MiB
llama_context:  CUDA_Host  output buffer size =     1.00 MiB
llama_kv_cache:      CUDA0 KV buffer size =   512.00 MiB
llama_kv_cache:      CUDA1 KV buffer size =   512.00 MiB
llama_context:      CUDA0 compute buffer size =   560.00 MiB
llama_context:      CUDA1 compute buffer size =   100.00 MiB
llama_context:  CUDA_Host compute buffer size =    24.00 MiB
"""
)


@pytest.mark.parametrize(
    ("log", "expected"),
    [
        # host buffers are RAM; the output buffer (under 1 MiB) is not counted
        (CUDA_TWO_GPUS, Footprint(305 * MIB, (3273 * MIB, 2814 * MIB))),
        # sliding-window layers: two KV caches, both counted
        (
            "llama_kv_cache:        CPU KV buffer size =    10.50 MiB\n"
            "llama_kv_cache:        CPU KV buffer size =     3.25 MiB\n",
            Footprint(round(13.75 * MIB)),
        ),
        # only GPU 1 used (--gpu-devices 1): GPU 0 holds nothing
        (
            USING.format("CUDA1", "02")
            + "load_tensors:   CUDA1 model buffer size =   100.00 MiB\n",
            Footprint(0, (0, 100 * MIB)),
        ),
        # Metal shares RAM; RPC buffers are on another machine
        (
            "llama_prepare_model_devices: using device MTL0 (Apple M3) (unknown id) - 9 MiB free\n"
            "llama_prepare_model_devices: using device RPC0 (127.0.0.1:50061) (x) - 9 MiB free\n"
            "load_tensors:   MTL0_Mapped model buffer size =   100.00 MiB\n"
            "llama_context:        MTL0 compute buffer size =    20.00 MiB\n"
            "load_tensors: RPC0[127.0.0.1:50061] model buffer size =    23.25 MiB\n",
            Footprint(120 * MIB),
        ),
        ("main: server is listening on http://127.0.0.1:8080\n", None),
    ],
)
def test_buffer_lines(log: str, expected: Footprint | None) -> None:
    assert footprint_from_log(log.splitlines()) == expected


def test_only_the_latest_load_counts() -> None:
    first = "llama_model_loader: loaded meta data with 30 key-value pairs\n" + (
        "load_tensors:   CPU_Mapped model buffer size =   100.00 MiB\n"
    )
    second = "llama_model_loader: loaded meta data with 30 key-value pairs\n" + (
        "load_tensors:   CPU_Mapped model buffer size =    60.00 MiB\n"
    )
    lines = (first + "main: exiting\n" + second).splitlines()
    assert footprint_from_log(last_load(lines)) == Footprint(60 * MIB)


async def test_the_real_llama_server_reports_what_it_holds(
    llama_server: Path, model_path: Path, tmp_path: Path
) -> None:
    """The weights buffer is the file's tensor bytes; the whole is within the fit estimate
    (which is meant to err on the safe side)."""
    log_file = tmp_path / "llama-server.log"
    config = LlamaServerConfig(
        binary=llama_server,
        model_path=model_path,
        alias="smol",
        slots=2,
        ctx_size=1024,
        log_file=log_file,
        threads=1,
        max_restarts=0,
        extra_args=("-lv", "4"),  # what the buffer lines need
    )
    ready = asyncio.Event()
    server = LlamaServer(
        config, lambda state, _: ready.set() if state is BackendState.READY else None
    )
    task = asyncio.create_task(server.run())
    try:
        async with asyncio.timeout(120):
            await ready.wait()
        lines = log_file.read_text(errors="replace").splitlines()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    measured = footprint_from_log(last_load(lines))
    info = inspect_cached(model_path)
    assert measured is not None and measured.gpus == ()
    assert measured.ram > info.tensor_bytes  # the weights, plus KV and compute
    assert measured.ram <= estimate(info, 2 * 1024, Footprint(8 << 30)).ram
