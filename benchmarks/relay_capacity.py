"""Relay capacity: how many tokens/s one router process relays, and the delay it adds.

A FAKE fast backend (benchmarks/fake_backend.py) streams one chunk per stream every
``--interval-ms``; several workers attach to it with ``--backend-url``; one client process
holds ``--streams`` concurrent streams through the router. Each chunk carries the time the
backend wrote it, so the client measures the *added gap*: (gap between two chunks as
received) - (gap between them as sent). The same client run straight against the fake
backend gives the floor that this machine's scheduling adds on its own.

    python benchmarks/relay_capacity.py --streams 500 --workers 2 --seconds 20

Target (issue 2): >= 20,000 tokens/s across 500 concurrent streams, p99 added gap <= 20 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from common import (
    cpu_seconds,
    free_port,
    median,
    pct,
    print_table,
    processes,
    wait_http,
    wait_workers,
    write_json,
)

TS_KEY = b'"shoal_bench_ts":'


@dataclass
class Tally:
    tokens: int = 0
    added_gaps_ms: list[float] = field(default_factory=list)
    errors: int = 0
    streams_done: int = 0


async def one_stream(
    session: aiohttp.ClientSession, url: str, tokens: int, tally: Tally, measure: asyncio.Event
) -> None:
    body = {
        "model": "fake",
        "stream": True,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": "go"}],
    }
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            tally.errors += 1
            await resp.read()
            return
        buf = b""
        prev_recv = prev_sent = 0.0
        async for piece in resp.content.iter_any():
            now = time.time()
            buf += piece
            *events, buf = buf.split(b"\n\n")
            for event in events:
                at = event.find(TS_KEY)
                if at < 0:
                    continue
                sent = float(event[at + len(TS_KEY) : event.index(b"}", at)])
                if measure.is_set():
                    tally.tokens += 1
                    if prev_recv:
                        tally.added_gaps_ms.append(((now - prev_recv) - (sent - prev_sent)) * 1e3)
                prev_recv, prev_sent = now, sent
    tally.streams_done += 1


async def drive(
    url: str, streams: int, tokens: int, warmup: float, seconds: float
) -> dict[str, float]:
    tally = Tally()
    measure = asyncio.Event()
    deadline = time.monotonic() + warmup + seconds
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)

    async def loop_stream(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            try:
                await one_stream(session, url, tokens, tally, measure)
            except aiohttp.ClientError:
                tally.errors += 1

    async with (
        aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
        asyncio.TaskGroup() as tg,
    ):
        for _ in range(streams):
            tg.create_task(loop_stream(session))
        await asyncio.sleep(warmup)
        measure.set()
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        measured = time.monotonic() - t0
        snapshot_tokens = tally.tokens
        gaps = list(tally.added_gaps_ms)
    return {
        "tokens_per_s": snapshot_tokens / measured,
        "added_gap_p50_ms": median(gaps),
        "added_gap_p99_ms": pct(gaps, 99),
        "added_gap_max_ms": max(gaps) if gaps else float("nan"),
        "errors": tally.errors,
        "gaps": len(gaps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--interval-ms", type=float, default=25.0)
    parser.add_argument("--tokens", type=int, default=200, help="tokens per stream request")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    args = parser.parse_args()

    backend_port, router_port = free_port(), free_port()
    backend = f"http://127.0.0.1:{backend_port}"
    router = f"http://127.0.0.1:{router_port}"
    logs = Path(__file__).parent / "results" / "logs" / "relay_capacity"
    slots = args.streams // args.workers + 8
    results: dict[str, dict[str, float]] = {}
    with processes(logs) as procs:
        procs.start(
            "fake-backend",
            [
                sys.executable,
                str(Path(__file__).parent / "fake_backend.py"),
                "--port",
                str(backend_port),
                "--interval-ms",
                str(args.interval_ms),
            ],
        )
        wait_http(backend + "/v1/models")
        procs.shoal(
            "router",
            "router",
            "--port",
            str(router_port),
            "--log-level",
            "warning",
            "--max-queue",
            str(args.streams * 2),
        )
        wait_http(router + "/health")
        for i in range(args.workers):
            procs.shoal(
                f"worker-{i}",
                "worker",
                "--router-url",
                f"127.0.0.1:{router_port}",
                "--backend-url",
                backend,
                "--model-alias",
                "fake",
                "--name",
                f"relay{i}",
                "--slots",
                str(slots),
                "--log-level",
                "warning",
            )
        wait_workers(router, args.workers)
        for name, base in (("direct to fake backend", backend), ("through router", router)):
            print(f"running {args.streams} streams {name} for {args.seconds:g} s ...", flush=True)
            before = {p: cpu_seconds(p.pid) for p in procs.procs}
            client_before = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.monotonic()
            results[name] = _run(
                drive(
                    base + "/v1/chat/completions",
                    args.streams,
                    args.tokens,
                    args.warmup,
                    args.seconds,
                )
            )
            wall = time.monotonic() - t0
            cpu = {n: (cpu_seconds(p.pid) - before[p]) / wall for n, p in procs.named.items()}
            client = resource.getrusage(resource.RUSAGE_SELF)
            cpu["client"] = (
                client.ru_utime + client.ru_stime - client_before.ru_utime - client_before.ru_stime
            ) / wall
            results[name].update({f"cpu_{n}": round(v, 3) for n, v in cpu.items()})
    rows = [
        [
            name,
            r["tokens_per_s"],
            r["added_gap_p50_ms"],
            r["added_gap_p99_ms"],
            r["added_gap_max_ms"],
            int(r["errors"]),
            r.get("cpu_router", 0.0),
            sum(v for k, v in r.items() if k.startswith("cpu_")),
        ]
        for name, r in results.items()
    ]
    print_table(
        f"Relay capacity: {args.streams} streams, {args.workers} workers, one chunk per stream "
        f"every {args.interval_ms:g} ms (target >= 20,000 tok/s, p99 added gap <= 20 ms)",
        [
            "path",
            "tokens/s",
            "added gap p50 ms",
            "p99 ms",
            "max ms",
            "errors",
            "router cores",
            "all cores",
        ],
        rows,
    )
    write_json(
        "relay_capacity",
        {
            "config": vars(args),
            "results": results,
            "targets": {"tokens_per_s": 20000, "added_gap_p99_ms": 20},
        },
    )


def _run(coro: Coroutine[Any, Any, dict[str, float]]) -> dict[str, float]:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


if __name__ == "__main__":
    main()
