"""A model split over two ggml-rpc-servers: one machine vs direct RPC vs RPC through the tunnel.

Five llama-servers, all up at once, asked in interleaved rounds (one request each per round):

  single        llama-server alone (its default threads: all cores)
  single-t1     llama-server alone with -t 1
  direct-stock  llama-server --rpc A,B -ngl 99 -ts 1,1 over two `ggml-rpc-server -t 1` with
                llama.cpp's defaults (what ggml-rpc-server picks on 2 cores; what Shoal ran
                before it set the stage threads and the OpenMP spin)
  direct        the same split run as Shoal runs it: stages with `-t` one per physical core,
                every process with Shoal's split environment (``llama_cpp.threads``)
  relayed       `direct` over another pair of ggml-rpc-servers (one serves one client at a
                time), each --rpc entry a HeadEndpoint -> TunnelHub -> StageConnector path

The relayed parts run as Shoal would run them (under uvloop): the hub in its own process (the
router's place), the head endpoints in a "head worker" process and both stage connectors in a "stage
worker" process. The hub asks for stage connections over a local TCP control connection (in
Shoal, a message on the stage worker's WebSocket).

Each request: temperature 0, ``ignore_eos``, ``cache_prompt: false``; the figure is
llama-server's own ``timings.predicted_per_second``. Medians over the rounds.

    python benchmarks/rpc_split.py --rounds 7 --tokens 128

Targets: direct >= 0.75x single; relayed >= 0.9x direct. Every part runs on this one machine,
so the split's processes share its cores, as a head and its stages never do across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from common import Processes, free_port, median, print_table, processes, wait_http, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shoal.hardware.detect import detect_machine  # noqa: E402
from shoal.llama_cpp.binaries import rpc_server_beside  # noqa: E402
from shoal.llama_cpp.locate import resolve  # noqa: E402
from shoal.llama_cpp.threads import spin_env, stage_threads  # noqa: E402
from shoal.models.default import DEFAULT_MODEL  # noqa: E402
from shoal.models.resolve import resolve_model  # noqa: E402
from shoal.settings import CommonSettings  # noqa: E402

PROMPT = "Tell me a long story about a lighthouse keeper and the sea."
CONFIGS = ("single", "single-t1", "direct-stock", "direct", "relayed")
CONFIG_KEYS = ("rounds", "tokens", "rpc_threads", "tensor_split", "head_threads")


# -- the relayed parts, each run as `python rpc_split.py --role ...` -----------------------


async def run_hub(stage_control: int, rpc_ports: list[int]) -> None:
    """The router's part: a TunnelHub; stage requests go to the stage process's control port."""
    from shoal.tunnel.handshake import StageWanted
    from shoal.tunnel.hub import TunnelHub

    _, control = await asyncio.open_connection("127.0.0.1", stage_control)
    ports: dict[str, int] = {}

    async def on_stage_wanted(wanted: StageWanted) -> None:
        msg = {
            "tunnel_id": wanted.tunnel_id,
            "conn_no": wanted.conn_no,
            "token": wanted.token,
            "port": ports[wanted.tunnel_id],
            "hub_port": hub.port,
        }
        control.write(json.dumps(msg).encode() + b"\n")
        await control.drain()

    hub = TunnelHub(on_stage_wanted)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(hub.serve())
        await hub.started.wait()
        tunnels = [hub.open_tunnel() for _ in rpc_ports]
        ports.update({t.id: p for t, p in zip(tunnels, rpc_ports, strict=True)})
        heads = [{"tunnel_id": t.id, "token": t.head_token} for t in tunnels]
        print(json.dumps({"port": hub.port, "heads": heads}), flush=True)


async def run_stage() -> None:
    """The stage worker's part: one StageConnector per ggml-rpc-server, driven by control lines."""
    from shoal.tunnel.endpoints import HubAddress, StageConnector, TunnelError
    from shoal.tunnel.handshake import StageWanted, TunnelId

    connectors: dict[int, StageConnector] = {}
    listener = await asyncio.start_server(lambda r, w: handle(r), "127.0.0.1", 0)
    print(json.dumps({"control": listener.sockets[0].getsockname()[1]}), flush=True)

    async def connect(msg: dict[str, Any]) -> None:
        hub = HubAddress("127.0.0.1", msg["hub_port"])
        connector = connectors.setdefault(msg["port"], StageConnector(hub, msg["port"]))
        wanted = StageWanted(TunnelId(msg["tunnel_id"]), msg["conn_no"], msg["token"])
        try:
            await connector.connect(wanted)
        except TunnelError as exc:
            print(f"stage: {exc}", file=sys.stderr, flush=True)

    async def handle(reader: asyncio.StreamReader) -> None:
        async with asyncio.TaskGroup() as tg:
            while line := await reader.readline():
                tg.create_task(connect(json.loads(line)))

    async with listener:
        await listener.serve_forever()


async def run_head(hub_port: int) -> None:
    """The head worker's part: one HeadEndpoint per tunnel (tunnels and tokens on stdin)."""
    from shoal.tunnel.endpoints import HeadEndpoint, HubAddress
    from shoal.tunnel.handshake import TunnelId

    heads = json.loads(sys.stdin.readline())
    hub = HubAddress("127.0.0.1", hub_port)
    endpoints = [HeadEndpoint(hub, TunnelId(h["tunnel_id"]), h["token"]) for h in heads]
    async with asyncio.TaskGroup() as tg:
        for endpoint in endpoints:
            tg.create_task(endpoint.serve())
        for endpoint in endpoints:
            await endpoint.started.wait()
        print(json.dumps({"rpc": [e.rpc_address for e in endpoints]}), flush=True)


def role_main(args: argparse.Namespace) -> None:
    """Under uvloop, as ``shoal router`` and ``shoal worker`` run."""
    import uvloop

    if args.role == "hub":
        uvloop.run(run_hub(args.stage_control, args.rpc_ports))
    elif args.role == "stage":
        uvloop.run(run_stage())
    else:
        uvloop.run(run_head(args.hub_port))


# -- the benchmark ---------------------------------------------------------------------------


def wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def start_role(
    procs: Processes, name: str, argv: list[str], stdin: str | None = None
) -> dict[str, Any]:
    """Start a helper role; return the JSON line it prints once ready."""
    procs.log_dir.mkdir(parents=True, exist_ok=True)
    log = (procs.log_dir / f"{name}.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, __file__, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
    )
    log.close()
    procs.procs.append(proc)
    assert proc.stdin is not None and proc.stdout is not None
    if stdin is not None:
        proc.stdin.write(stdin.encode() + b"\n")
        proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{name} exited: see {procs.log_dir / (name + '.log')}")
    result: dict[str, Any] = json.loads(line)
    return result


def llama_argv(binary: Path, model: Path, port: int, *extra: str) -> list[str]:
    return [
        str(binary),
        *("-m", str(model), "--host", "127.0.0.1", "--port", str(port)),
        *("-c", "1024", "-np", "1", "--cache-ram", "0", "--no-webui", *extra),
    ]


def generate(port: int, tokens: int) -> float:
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
        "cache_prompt": False,
        "ignore_eos": True,
    }
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
    resp.raise_for_status()
    data = resp.json()
    assert data["usage"]["completion_tokens"] == tokens, data["usage"]
    return float(data["timings"]["predicted_per_second"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--rpc-threads", type=int, help="ggml-rpc-server -t for direct/relayed (default: Shoal's)"
    )
    parser.add_argument("--tensor-split", default="1,1")
    parser.add_argument(
        "--head-threads", type=int, help="llama-server -t for the split heads (default: its own)"
    )
    parser.add_argument("--role", choices=["hub", "stage", "head"], help=argparse.SUPPRESS)
    parser.add_argument("--hub-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--stage-control", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rpc-ports", type=int, nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        role_main(args)
        return
    bench(args)


def bench(args: argparse.Namespace) -> None:
    cache = CommonSettings().cache_dir
    binary = resolve(explicit=None, cache_dir=cache, path_env=None, allow_build=False).llama_server
    rpc_binary = rpc_server_beside(binary)
    assert rpc_binary is not None, "ggml-rpc-server is not beside llama-server"
    model = resolve_model(DEFAULT_MODEL.id, cache, download=False).path
    args.rpc_threads = args.rpc_threads or stage_threads(None, detect_machine().cpu)
    shoal_env = {**os.environ, **spin_env(os.environ)}
    with processes(Path("/tmp/shoal-bench-rpc-split")) as procs:
        rpc_ports = [free_port() for _ in range(6)]
        for n, port in enumerate(rpc_ports):
            stock = n < 2
            threads = 1 if stock else args.rpc_threads
            argv = [str(rpc_binary), "-p", str(port), "-t", str(threads)]
            procs.start(f"rpc{n}", argv, None if stock else shoal_env)
        for port in rpc_ports:
            wait_port(port)
        relayed = start_relay(procs, rpc_ports[4:])
        split: tuple[str, ...] = ("-ngl", "99", "-ts", args.tensor_split)
        if args.head_threads:
            split += ("-t", str(args.head_threads))
        ports = {name: free_port() for name in CONFIGS}
        rpc = {
            "single": (),
            "single-t1": ("-t", "1"),
            "direct-stock": ("--rpc", ",".join(f"127.0.0.1:{p}" for p in rpc_ports[:2]), *split),
            "direct": ("--rpc", ",".join(f"127.0.0.1:{p}" for p in rpc_ports[2:4]), *split),
            "relayed": ("--rpc", relayed, *split),
        }
        for name in CONFIGS:
            env = shoal_env if name in ("direct", "relayed") else None
            procs.start(name, llama_argv(binary, model, ports[name], *rpc[name]), env)
        for name in CONFIGS:
            wait_http(f"http://127.0.0.1:{ports[name]}/health")
        results = measure(args, lambda name: generate(ports[name], args.tokens))
    report(args, results)


def start_relay(procs: Processes, rpc_ports: list[int]) -> str:
    """Stage, hub and head processes; returns the --rpc list of the head's endpoints."""
    stage = start_role(procs, "stage", ["--role", "stage"])
    ports = [str(p) for p in rpc_ports]
    hub = start_role(
        procs,
        "hub",
        ["--role", "hub", "--stage-control", str(stage["control"]), "--rpc-ports", *ports],
    )
    head = start_role(
        procs, "head", ["--role", "head", "--hub-port", str(hub["port"])], json.dumps(hub["heads"])
    )
    return ",".join(head["rpc"])


def measure(args: argparse.Namespace, run: Callable[[str], float]) -> dict[str, list[float]]:
    for name in CONFIGS:  # warm-up (first request after load is slower)
        run(name)
    results: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for n in range(args.rounds):
        order = CONFIGS if n % 2 == 0 else tuple(reversed(CONFIGS))
        for name in order:
            results[name].append(run(name))
        print(f"round {n + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in results.items()))
    return results


def report(args: argparse.Namespace, results: dict[str, list[float]]) -> None:
    med = {name: median(values) for name, values in results.items()}
    pairs = {
        "direct/single": ("direct", "single"),
        "relayed/direct": ("relayed", "direct"),
        "relayed/single": ("relayed", "single"),
        "direct/direct-stock": ("direct", "direct-stock"),
        "direct-stock/single": ("direct-stock", "single"),
    }
    ratios = {k: med[a] / med[b] for k, (a, b) in pairs.items()}
    # the same ratio within each round, then the median: drifts in machine load cancel out
    round_ratios = {
        k: median([x / y for x, y in zip(results[a], results[b], strict=True)])
        for k, (a, b) in pairs.items()
    }
    rows = [[name, med[name], min(results[name]), max(results[name])] for name in CONFIGS]
    print_table(
        f"Generation tokens/s, {args.tokens} tokens, medians of {args.rounds} rounds",
        ["config", "median tok/s", "min", "max"],
        rows,
    )
    print_table(
        "Ratios (targets: direct/single >= 0.75, relayed/direct >= 0.9)",
        ["ratio", "of medians", "median of per-round"],
        [[k, ratios[k], round_ratios[k]] for k in pairs],
    )
    write_json(
        "rpc_split",
        {
            "config": {k: vars(args)[k] for k in CONFIG_KEYS} | {"split_env": spin_env(os.environ)},
            "load_average_after": os.getloadavg(),
            "tokens_per_second": results,
            "medians": med,
            "ratios": ratios,
            "per_round_ratio_medians": round_ratios,
            "targets": {"direct/single": 0.75, "relayed/direct": 0.9},
        },
    )


if __name__ == "__main__":
    main()
