"""Jobs/s and added latency per request: the in-process queue versus the Redis queue.

A FAKE fast backend (benchmarks/fake_backend.py) answers every request with ``--tokens``
chunks one tick (``--interval-ms``) apart; two workers attach to it with ``--backend-url``.
``--concurrency`` client loops send short non-streamed chat requests, one after another, for
``--seconds``: straight to the fake backend (the floor), through a router with the default
in-process queue, and through a router with ``--redis-url`` (every job goes through Redis
Streams: enqueue, claim, output stream, ack). Each run gets its own router and workers.

    python benchmarks/queue_backends.py --concurrency 16 --seconds 15
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import redis
import uvloop

from common import (
    free_port,
    median,
    pct,
    print_table,
    processes,
    wait_http,
    wait_workers,
    write_json,
)

REDIS_URL = "redis://127.0.0.1:6379/0"


async def drive(url: str, concurrency: int, seconds: float, warmup: float) -> dict[str, float]:
    latencies: list[float] = []
    errors = 0
    body = {"model": "fake", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    start = time.monotonic()
    measure_from, stop_at = start + warmup, start + warmup + seconds

    async def loop(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        while (now := time.monotonic()) < stop_at:
            async with session.post(url, json=body) as resp:
                await resp.read()
                ok = resp.status == 200
            if now >= measure_from:
                latencies.append(time.monotonic() - now)
                errors += not ok

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(loop(session) for _ in range(concurrency)))
    ms = [x * 1000 for x in latencies]
    return {
        "jobs_per_s": round(len(ms) / seconds, 1),
        "latency_p50_ms": round(median(ms), 3),
        "latency_p99_ms": round(pct(ms, 99), 3),
        "requests": len(ms),
        "errors": errors,
    }


def run_through_router(
    args: argparse.Namespace, backend: str, extra: list[str], tag: str
) -> dict[str, float]:
    router_port = free_port()
    router = f"http://127.0.0.1:{router_port}"
    logs = Path(__file__).parent / "results" / "logs" / f"queue_backends-{tag}"
    with processes(logs) as procs:
        procs.shoal(
            "router", "router", "--port", str(router_port), "--log-level", "warning", *extra
        )
        wait_http(router + "/health")
        for i in range(2):
            procs.shoal(
                f"worker-{i}",
                "worker",
                *("--router-url", f"127.0.0.1:{router_port}", "--backend-url", backend),
                *("--model-alias", "fake", "--name", f"{tag}{i}", "--slots", "64"),
                *("--log-level", "warning"),
            )
        wait_workers(router, 2)
        return _run(drive(router + "/v1/chat/completions", args.concurrency, args.seconds, 2.0))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--interval-ms", type=float, default=1.0)
    args = parser.parse_args()
    backend_port = free_port()
    backend = f"http://127.0.0.1:{backend_port}"
    prefix = f"shoal-bench-{uuid.uuid4().hex[:8]}:"
    results: dict[str, dict[str, float]] = {}
    logs = Path(__file__).parent / "results" / "logs" / "queue_backends"
    try:
        with processes(logs) as procs:
            fake = Path(__file__).parent / "fake_backend.py"
            procs.start(
                "fake-backend",
                [sys.executable, str(fake), "--port", str(backend_port)]
                + ["--interval-ms", str(args.interval_ms)],
            )
            wait_http(backend + "/v1/models")
            print("direct to the fake backend ...", flush=True)
            results["direct to fake backend"] = _run(
                drive(backend + "/v1/chat/completions", args.concurrency, args.seconds, 2.0)
            )
            print("through a router, in-process queue ...", flush=True)
            results["router, in-process queue"] = run_through_router(args, backend, [], "memory")
            print("through a router, Redis queue ...", flush=True)
            redis_flags = ["--redis-url", REDIS_URL, "--redis-prefix", prefix]
            results["router, Redis queue"] = run_through_router(args, backend, redis_flags, "redis")
    finally:
        _clean(prefix)
    floor = results["direct to fake backend"]["latency_p50_ms"]
    rows = [
        [
            name,
            r["jobs_per_s"],
            r["latency_p50_ms"],
            r["latency_p99_ms"],
            round(r["latency_p50_ms"] - floor, 3),
            int(r["errors"]),
        ]
        for name, r in results.items()
    ]
    print_table(
        f"Queue backends: {args.concurrency} clients, non-streamed requests, fake backend",
        ["path", "jobs/s", "p50 ms", "p99 ms", "added p50 ms", "errors"],
        rows,
    )
    write_json("queue_backends", {"config": vars(args), "results": results})


def _clean(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for key in client.scan_iter(match=prefix + "*", count=500):
            client.unlink(key)
    finally:
        client.close()


def _run(coro: Any) -> dict[str, float]:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        result: dict[str, float] = runner.run(coro)
        return result


if __name__ == "__main__":
    main()
