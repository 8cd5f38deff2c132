"""Round-trip latency of small messages through the tunnel's relays (no llama.cpp).

A client sends 64 bytes and waits for the echo, ``--messages`` times, to an echo service:
straight, through one relay of each kind (in its own process), and through the whole tunnel
(HeadEndpoint -> TunnelHub -> StageConnector, three processes as in rpc_split.py). llama.cpp's
RPC makes several such round trips per token, so this is what the tunnel adds per trip.

    python benchmarks/tunnel_latency.py --rounds 3 --messages 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import Processes, median, pct, print_table, processes, write_json
from rpc_split import start_relay

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shoal.tunnel.relay import SocketRelay, relay_streams, tune  # noqa: E402

ONE_HOP = ("copy", "splice", "streams", "streams-uvloop")


def run_echo() -> None:
    """The echo service (its own process): blocking threads, one per connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"port": listener.getsockname()[1]}), flush=True)

    def serve(conn: socket.socket) -> None:
        tune(conn)
        buf = bytearray(65536)
        with conn:
            while n := conn.recv_into(buf):
                conn.sendall(memoryview(buf)[:n])

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def ping_pong(port: int, messages: int, size: int = 64) -> list[float]:
    sock = socket.create_connection(("127.0.0.1", port))
    tune(sock)
    msg, buf = os.urandom(size), bytearray(size)
    times = []
    with sock:
        for n in range(messages + 50):
            start = time.perf_counter()
            sock.sendall(msg)
            got = 0
            while got < size:
                got += sock.recv_into(memoryview(buf)[got:])
            if n >= 50:  # the first trips warm up threads and caches
                times.append((time.perf_counter() - start) * 1e6)
    return times


def run_one_hop(kind: str, target: int) -> None:
    """A relay process: every connection to its port is relayed to ``target``."""
    if kind == "streams-uvloop":
        import uvloop

        uvloop.install()
    listener = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
    if kind in ("copy", "splice"):
        while True:
            conn, _ = listener.accept()
            upstream = socket.create_connection(("127.0.0.1", target))
            SocketRelay(conn, upstream, name="bench", mode=kind).start()  # type: ignore[arg-type]

    async def serve() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await relay_streams(
                (reader, writer), await asyncio.open_connection("127.0.0.1", target)
            )

        server = await asyncio.start_server(handle, sock=listener)
        await server.serve_forever()

    asyncio.run(serve())


def start_helper(procs: Processes, *argv: str) -> int:
    """Start this script in a helper role; returns the port it prints."""
    proc = subprocess.Popen(
        [sys.executable, __file__, *argv],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    procs.procs.append(proc)
    assert proc.stdout is not None
    return int(json.loads(proc.stdout.readline())["port"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--relay", choices=ONE_HOP, help=argparse.SUPPRESS)
    parser.add_argument("--target", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--echo", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.relay:
        run_one_hop(args.relay, args.target)
        return
    if args.echo:
        run_echo()
        return
    with processes(Path("/tmp/shoal-bench-tunnel-latency")) as procs:
        echo = start_helper(procs, "--echo")
        ports = {"none": echo}
        ports.update(
            {kind: start_helper(procs, "--relay", kind, "--target", str(echo)) for kind in ONE_HOP}
        )
        tunnel = start_relay(procs, [echo])
        ports["tunnel (3 hops)"] = int(tunnel.rsplit(":", 1)[1])
        samples: dict[str, list[float]] = {name: [] for name in ports}
        for _ in range(args.rounds):
            for name, port in ports.items():
                samples[name] += ping_pong(port, args.messages)
    rows, results = [], {}
    for name, times in samples.items():
        p50, p99 = median(times), pct(times, 99)
        added = p50 - median(samples["none"])
        results[name] = {"rtt_p50_us": p50, "rtt_p99_us": p99, "added_p50_us": added}
        rows.append([name, p50, p99, added])
    print_table(
        f"64-byte round trips, {args.rounds} x {args.messages} per path (microseconds)",
        ["relay", "RTT p50", "RTT p99", "added p50"],
        rows,
    )
    write_json("tunnel_latency", {"config": vars(args), "results": results})


if __name__ == "__main__":
    main()
