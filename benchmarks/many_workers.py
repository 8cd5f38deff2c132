"""One router, thousands of idle workers: what the fleet costs the router while it idles.

For each fleet size (``--workers``, 1,000, 5,000 and 10,000 by default) a fresh router process
(in-process queue, or ``--redis-url`` where the worker directory is shared through Redis) and
that many STAND-IN workers (``benchmarks/standins.py``: protocol-level fakes that register
with the real wire messages, then heartbeat at the interval the router asks for, nothing
else; run in processes of their own, so their CPU is not the router's). Reported:

* the time until all of them registered;
* the router process's own CPU (cores: CPU seconds over wall seconds) and RSS over an idle
  window (``--idle-s``), with ``--probes`` requests each to ``/health`` and ``/v1/models``
  spread over it, and their latency p50;
* with ``--real-workers K`` (default 2): K real ``shoal worker`` processes join the fleet,
  attached to one real llama-server with the default model, and the same window is measured
  again with a trickle of real chat requests (one every ``--trickle-gap-s``) placed on them
  among all the stand-ins: their latency p50, and the router's CPU with them;
* placement among N workers (``place p50``): ``MemoryDispatcher.submit`` in this process,
  over a registry of N real ``WorkerConnection`` objects built from the stand-ins'
  registrations and one real-model worker: the router's whole path for a request that finds
  a free slot (``check_served``, the context check, ``pick_worker``, the ``JobStart``).

    python benchmarks/many_workers.py                       # 1k, 5k, 10k, in memory
    python benchmarks/many_workers.py --workers 5000 --redis-url redis://127.0.0.1:6379/0

Run it under ``flock /tmp/shoal-heavy.lock`` on a shared machine; the load average is
recorded with the figures. Targets (issue 31): 10,000 idle workers at <= 0.10 of a core and
<= 600 MiB, ``/v1/models`` p50 <= 20 ms, all registered in <= 10 s, CPU at 10k <= 2.2x that
at 5k, placement p50 <= 1 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis

from common import (
    Processes,
    cpu_seconds,
    free_port,
    median,
    print_table,
    processes,
    wait_http,
    write_json,
)
from placement_timing import placement_p50_ms
from shoal.llama_cpp.locate import resolve
from shoal.models.default import DEFAULT_MODEL
from shoal.models.resolve import resolve_model
from shoal.settings import CommonSettings

STANDINS_PER_PROCESS = 2500
REAL_MODEL = "bench"
HERE = Path(__file__).parent


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_fleet(procs: Processes, router: str, count: int) -> tuple[float, int]:
    """Start ``count`` stand-ins in processes of ``STANDINS_PER_PROCESS``; the seconds until
    the last of them registered (the slowest process's own count, from its first dial), and
    how many dials, registrations or connections failed on the way (each dialed again)."""
    started: list[subprocess.Popen[bytes]] = []
    for n, first in enumerate(range(0, count, STANDINS_PER_PROCESS)):
        size = min(STANDINS_PER_PROCESS, count - first)
        argv = [sys.executable, str(HERE / "standins.py"), "--router", router]
        argv += ["--count", str(size), "--first", str(first)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=os.environ.copy())
        procs.procs.append(proc)
        procs.named[f"standins-{n}"] = proc
        started.append(proc)
    took, failures = [], 0
    for proc in started:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("a stand-in process ended before its fleet registered")
        took.append(float(json.loads(line)["s"]))
        failures += int(json.loads(line)["failures"])
    return max(took), failures


def probe(client: httpx.Client, url: str, path: str) -> float:
    """One request on a kept-alive connection: the router's latency, not a TCP set-up's."""
    started = time.perf_counter()
    reply = client.get(url + path, timeout=30)
    reply.raise_for_status()
    return (time.perf_counter() - started) * 1000


def chat(url: str) -> float:
    body = {
        "model": REAL_MODEL,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
    }
    started = time.perf_counter()
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    reply.raise_for_status()
    return (time.perf_counter() - started) * 1000


def window(
    pid: int, url: str, seconds: float, probes: int, trickle: Callable[[], list[float]] | None
) -> dict[str, float]:
    """The router's CPU (cores) and RSS over ``seconds``, with ``probes`` of each endpoint
    spread over it (and the trickle of real requests, run beside them, when given)."""
    lat: dict[str, list[float]] = {"/health": [], "/v1/models": []}
    trickled: list[float] = []
    thread = None
    if trickle is not None:
        thread = threading.Thread(target=lambda: trickled.extend(trickle()))
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    if thread is not None:
        thread.start()
    gap = seconds / probes
    with httpx.Client() as client:
        for path in lat:
            probe(client, url, path)  # opens the connection the probes keep
        for i in range(probes):
            for path in lat:
                lat[path].append(probe(client, url, path))
            time.sleep(max(0.0, t0 + (i + 1) * gap - time.monotonic()))
    if thread is not None:
        thread.join()
    cpu1, t1 = cpu_seconds(pid), time.monotonic()
    result = {
        "cpu_cores": (cpu1 - cpu0) / (t1 - t0),
        "rss_mib": rss_mib(pid),
        "health_p50_ms": median(lat["/health"]),
        "models_p50_ms": median(lat["/v1/models"]),
    }
    if trickle is not None:
        result["chat_p50_ms"] = median(trickled)
        result["chats"] = len(trickled)
    return result


def real_workers(procs: Processes, router_port: int, count: int) -> None:
    """``count`` real workers attached to one real llama-server with the default model."""
    cache = CommonSettings().cache_dir
    binary = resolve(explicit=None, cache_dir=cache, path_env=None, allow_build=False)
    model = resolve_model(DEFAULT_MODEL.id, cache, download=False)
    port = free_port()
    llama = [str(binary.llama_server), "-m", str(model.path), "--alias", REAL_MODEL]
    llama += ["--port", str(port), "-np", str(count), "-c", str(1024 * count), "--no-webui"]
    procs.start("llama-server", [*llama, "--threads", "1"])
    wait_http(f"http://127.0.0.1:{port}/health")
    for n in range(count):
        procs.shoal(
            f"worker-{n}",
            "worker",
            "--router-url",
            f"127.0.0.1:{router_port}",
            "--backend-url",
            f"http://127.0.0.1:{port}",
            "--model-alias",
            REAL_MODEL,
            "--slots",
            "1",
            "--log-level",
            "warning",
        )


def run_one(args: argparse.Namespace, count: int, prefix: str) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs = HERE / "results" / "logs" / "many_workers"
    with processes(logs) as procs:
        flags = ["--port", str(port), "--log-level", "warning"]
        if args.redis_url:
            flags += ["--redis-url", args.redis_url, "--redis-prefix", prefix]
        if args.profile:  # the router under cProfile (its CPU figures are then inflated)
            out = Path(args.profile) / f"router-{count}.prof"
            argv = [sys.executable, "-m", "cProfile", "-o", str(out), "-m", "shoal", "router"]
            router = procs.start("router", [*argv, *flags])
        else:
            router = procs.shoal("router", "router", *flags)
        wait_http(url + "/health")
        print(f"{count} stand-ins ...", flush=True)
        registered_s, failures = start_fleet(procs, f"127.0.0.1:{port}", count)
        time.sleep(args.settle_s)
        idle = window(router.pid, url, args.idle_s, args.probes, None)
        print(f"  idle: {idle}", flush=True)
        row: dict[str, Any] = {"workers": count, "register_s": registered_s, "idle": idle}
        row["register_failures"] = failures
        if args.real_workers:
            real_workers(procs, port, args.real_workers)
            wait_workers_count(url, count + args.real_workers)
            time.sleep(args.settle_s)

            def trickle() -> list[float]:
                done: list[float] = []
                end = time.monotonic() + args.idle_s - args.trickle_gap_s
                while time.monotonic() < end:
                    done.append(chat(url))
                    time.sleep(args.trickle_gap_s)
                return done

            row["trickle"] = window(router.pid, url, args.idle_s, args.probes, trickle)
            print(f"  trickle: {row['trickle']}", flush=True)
    row["place_p50_ms"] = placement_p50_ms(count)
    return row


def wait_workers_count(url: str, count: int, timeout: float = 120) -> None:
    """Until ``/health`` counts ``count`` ready workers (the real ones registered too)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health", timeout=30).json()
        if health["ready_workers"] >= count:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{count} workers did not become ready within {timeout} s")


def clean(redis_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.unlink(*keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=lambda s: [int(n) for n in s.split(",")])
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("--settle-s", type=float, default=6.0)
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--real-workers", type=int, default=2)
    parser.add_argument("--trickle-gap-s", type=float, default=2.0)
    parser.add_argument("--profile", default=None, help="a folder: cProfile the router there")
    parser.add_argument("--name", default=None, help="the JSON file's name (results/NAME.json)")
    args = parser.parse_args()
    # A TERM (``timeout``) stops the processes started here too (``processes`` cleans up).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = args.workers or [1000, 5000, 10000]
    load_before = os.getloadavg()
    rows = []
    for count in sizes:
        prefix = f"shoal-bench-{uuid.uuid4().hex[:8]}:"
        try:
            rows.append(run_one(args, count, prefix))
        finally:
            if args.redis_url:
                clean(args.redis_url, prefix)
    load_after = os.getloadavg()
    table = []
    for r in rows:
        idle, trickle = r["idle"], r.get("trickle", {})
        table.append(
            [
                r["workers"],
                r["register_s"],
                r["register_failures"],
                idle["cpu_cores"],
                idle["rss_mib"],
                idle["health_p50_ms"],
                idle["models_p50_ms"],
                trickle.get("cpu_cores", float("nan")),
                trickle.get("models_p50_ms", float("nan")),
                trickle.get("chat_p50_ms", float("nan")),
                r["place_p50_ms"],
            ]
        )
    queue = "redis" if args.redis_url else "memory"
    print_table(
        f"one router ({queue}), N stand-in workers; load {load_before} -> {load_after}",
        [
            "workers",
            "register s",
            "failed dials",
            "idle cores",
            "RSS MiB",
            "/health ms",
            "/v1/models ms",
            "trickle cores",
            "trickle /v1/models ms",
            "chat ms",
            "place ms",
        ],
        table,
    )
    if len(rows) > 1:
        cores = [r["idle"]["cpu_cores"] for r in rows]
        ratios = [b / a for a, b in zip(cores, cores[1:], strict=False)]
        print("CPU ratio between successive sizes:", [round(x, 2) for x in ratios])
    write_json(
        args.name or f"many_workers-{queue}",
        {
            "queue": queue,
            "load_before": load_before,
            "load_after": load_after,
            "rows": rows,
            "median_register_s": statistics.median(r["register_s"] for r in rows),
        },
    )


if __name__ == "__main__":
    main()
