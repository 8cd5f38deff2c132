"""A model split over two REAL ggml-rpc-servers, reached only through the tunnel.

llama-server --rpc -> HeadEndpoint -> TunnelHub -> StageConnector -> ggml-rpc-server (127.0.0.1),
with the hub and both worker ends in this test's event loop. The greedy answer must equal a
single llama-server's, and llama-server's log must show each stage holding part of the model.
"""

from __future__ import annotations

import asyncio
import functools
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import http_calls
from cluster import Proc, clean_env, free_port, wait_until
from shoal.llama_cpp.binaries import rpc_server_beside
from tunnel_rig import tunnel_rig

PROMPT = "Write one sentence about the sea."
TOKENS = 32


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    try:
        yield started
    finally:
        for proc in reversed(started):
            proc.stop()


def start(procs: list[Proc], tmp_path: Path, name: str, argv: list[str]) -> Proc:
    proc = Proc(name, argv, tmp_path / f"{name}.log", clean_env()).start()
    procs.append(proc)
    return proc


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def server_argv(llama_server: Path, model_path: Path, port: int, *extra: str) -> list[str]:
    return [
        str(llama_server),
        *("-m", str(model_path), "--host", "127.0.0.1", "--port", str(port)),
        *("-c", "512", "-np", "1", "-t", "1", "--cache-ram", "0", "--no-webui", *extra),
    ]


async def complete(port: int, proc: Proc) -> str:
    def healthy() -> bool:
        assert proc.alive(), proc.log()[-3000:]
        return http_calls.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200

    await asyncio.to_thread(wait_until, healthy, 60, "llama-server /health")
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "cache_prompt": False,
        "ignore_eos": True,  # always TOKENS tokens, so the comparison covers all of them
    }
    async with httpx.AsyncClient(timeout=60) as client:
        resp = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
    resp.raise_for_status()
    data = resp.json()
    assert data["usage"]["completion_tokens"] == TOKENS
    return str(data["choices"][0]["message"]["content"])


async def test_split_through_the_tunnel_matches_one_server(
    llama_server: Path, model_path: Path, tmp_path: Path, procs: list[Proc]
) -> None:
    rpc_server = rpc_server_beside(llama_server)
    assert rpc_server is not None, "ggml-rpc-server is not beside llama-server"

    single_port = free_port()
    single = start(procs, tmp_path, "single", server_argv(llama_server, model_path, single_port))
    expected = await complete(single_port, single)
    single.stop()

    stage_ports = [free_port(), free_port()]
    for n, port in enumerate(stage_ports):
        start(procs, tmp_path, f"stage{n}", [str(rpc_server), "-p", str(port), "-t", "1"])
    for port in stage_ports:
        await asyncio.to_thread(wait_until, functools.partial(port_open, port), 30, "rpc server")

    async with tunnel_rig() as rig:
        tunnels = [rig.open(port) for port in stage_ports]
        heads = [await rig.head(tunnel) for tunnel in tunnels]
        rpc = ",".join(head.rpc_address for head in heads)
        split_port = free_port()
        argv = server_argv(llama_server, model_path, split_port, "--rpc", rpc)
        split = start(procs, tmp_path, "split", [*argv, "-ngl", "99", "-ts", "1,1", "-lv", "4"])
        got = await complete(split_port, split)
        log = split.log()
        split.stop()
        for tunnel in tunnels:
            rig.hub.close_tunnel(tunnel.id)

    assert got == expected
    for n, head in enumerate(heads):
        # each RPC device is our endpoint, and it holds part of the model's weights
        assert f"using device RPC{n} ({head.rpc_address})" in log, log[-4000:]
        address = re.escape(head.rpc_address)
        size = re.search(rf"RPC\d\[{address}\] model buffer size = +([\d.]+) MiB", log)
        assert size is not None, log[-4000:]
        assert float(size.group(1)) > 10
    for tunnel in tunnels:
        # the weights went through the tunnel (the stage's share of 90 MB), and answers came back
        assert tunnel.bytes_head_to_stage > 10_000_000
        assert tunnel.bytes_stage_to_head > 0
        assert tunnel.connections >= 1
    assert rig.stage_errors == []
    for n in range(2):
        assert "Accepted client connection" in (tmp_path / f"stage{n}.log").read_text()
