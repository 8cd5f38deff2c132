"""Workers on one host: two workers of the default model on this machine behind one router.

``--requests`` (6) short chats at once (``--max-tokens`` 60, ``ignore_eos``), ``--rounds``
(3) times; wall time, TTFT p50 and completion tokens/s, the medians of the rounds. Three
modes in one run, each with fresh processes:

- ``single``: one worker (what this machine does with one llama-server);
- ``old``: two workers as Shoal ran them before issue 24: each llama-server on every usable
  core (``--threads CORES``, llama.cpp's own default) with libgomp's default spin
  (``GOMP_SPINCOUNT=300000`` in the workers' environment, which Shoal leaves alone);
- ``new``: two workers that decide themselves: the second takes the cores the first leaves
  (at least one thread; ``llama_cpp.threads.server_threads``), both with the short spin.

The workers start one after the other (the second once the first is ready: it must see the
first's llama-server). Issue 24's figures, three workers on 2 cores: six 60-token chats in
58.4 s instead of 2.4 s, and 2.8 s with ``--threads 1`` and ``GOMP_SPINCOUNT=20000`` on the
extra worker. Other llama.cpp servers running on this machine count for ``new`` (as they do
for a worker), so run it on a quiet machine; the load average is recorded with the figures.

    python benchmarks/workers_one_host.py
    python benchmarks/workers_one_host.py --modes old new --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from common import free_port, median, print_table, processes, wait_http, wait_workers, write_json

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
from shoal.hardware.cpu_quota import detect_usable_cores  # noqa: E402
from shoal.hardware.detect import detect_machine  # noqa: E402
from shoal.llama_cpp.host_servers import threads_in_args  # noqa: E402
from shoal.llama_cpp.locate import resolve  # noqa: E402
from shoal.models.default import DEFAULT_MODEL  # noqa: E402
from shoal.models.resolve import resolve_model  # noqa: E402
from shoal.settings import CommonSettings  # noqa: E402

MODEL = "bench"
MODES = ("single", "old", "new")
OLD_SPINCOUNT = "300000"
"""libgomp's default: what every llama-server spun before Shoal set a short spin."""
WARNING = "llama.cpp server(s) on"


@dataclass
class Round:
    seconds: float
    ttft_s: list[float]
    tokens: int
    errors: int


@dataclass
class Run:
    rounds: list[Round] = field(default_factory=list)
    threads: list[int | None] = field(default_factory=list)
    """Each worker's llama-server ``--threads`` (None: not given)."""
    warned: list[bool] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)


async def chat(client: httpx.AsyncClient, k: int, max_tokens: int) -> tuple[float, int]:
    """One streamed chat: its TTFT and completion tokens."""
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"Question {k}: tell me about the sea."}],
    }
    t0 = time.perf_counter()
    ttft = float("nan")
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft != ttft and any(c.get("delta", {}).get("content") for c in chunk["choices"]):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    return ttft, tokens


async def one_round(router: str, args: argparse.Namespace, first: int) -> Round:
    limits = httpx.Limits(max_connections=args.requests + 2)
    async with httpx.AsyncClient(base_url=router, timeout=900, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(chat(client, first + k, args.max_tokens) for k in range(args.requests)),
            return_exceptions=True,
        )
        seconds = time.perf_counter() - t0
    done = [r for r in results if not isinstance(r, BaseException)]
    for r in results:
        if isinstance(r, BaseException):
            print(f"  request failed: {r!r}")
    return Round(seconds, [t for t, _ in done], sum(n for _, n in done), len(results) - len(done))


def llama_server_threads(worker_pid: int) -> int | None:
    for child in psutil.Process(worker_pid).children(recursive=True):
        if child.name() == "llama-server":
            return threads_in_args(child.cmdline())
    raise RuntimeError(f"worker pid {worker_pid} has no llama-server")


def run_mode(mode: str, args: argparse.Namespace, cores: int, logs: Path) -> Run:
    cache = CommonSettings().cache_dir
    binary = resolve(explicit=None, cache_dir=cache, path_env=None, allow_build=False)
    model = resolve_model(DEFAULT_MODEL.id, cache, download=False)
    run = Run()
    with processes(logs) as procs:
        port = free_port()
        router = f"http://127.0.0.1:{port}"
        procs.shoal(
            f"router-{mode}",
            *("router", "--port", str(port), "--max-wait", "900", "--log-level", "warning"),
        )
        wait_http(router + "/health")
        workers = 1 if mode == "single" else 2
        env = {**os.environ, "GOMP_SPINCOUNT": OLD_SPINCOUNT} if mode == "old" else None
        for w in range(workers):
            argv = [sys.executable, "-m", "shoal", "worker", "--router-url", f"127.0.0.1:{port}"]
            argv += ["--name", f"w{w}", "--llama-server-path", str(binary.llama_server)]
            argv += ["--model", str(model.path), "--model-alias", MODEL]
            argv += ["--slots", str(args.slots), "--log-level", "warning"]
            argv += ["--threads", str(cores)] if mode == "old" else []
            proc = procs.start(f"worker{w}-{mode}", argv, env)
            wait_workers(router, w + 1)
            run.threads.append(llama_server_threads(proc.pid))
        load_before = os.getloadavg()[0]
        for n in range(args.rounds):
            print(f"{mode}: round {n + 1} of {args.rounds} ...", flush=True)
            r = asyncio.run(one_round(router, args, n * args.requests))
            run.rounds.append(r)
            print(f"  {r.seconds:.1f} s, TTFT p50 {median(r.ttft_s):.2f} s, {r.tokens} tokens")
        run.load = (load_before, os.getloadavg()[0])
        run.warned = [
            WARNING in (logs / f"worker{w}-{mode}.log").read_text() for w in range(workers)
        ]
    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=6, help="chats at once, per round")
    parser.add_argument("--max-tokens", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    cores = detect_usable_cores(detect_machine().cpu)
    logs = Path(__file__).parent / "results" / "logs" / "workers_one_host"
    runs: dict[str, Run] = {}
    for mode in args.modes:  # the table and JSON after each mode: a slow mode loses nothing
        runs[mode] = run_mode(mode, args, cores, logs)
        report(args, cores, runs)


def report(args: argparse.Namespace, cores: int, runs: dict[str, Run]) -> None:
    rows: list[list[object]] = []
    results: dict[str, object] = {}
    for mode, run in runs.items():
        wall = median([r.seconds for r in run.rounds])
        ttft = median([median(r.ttft_s) for r in run.rounds])
        rate = median([r.tokens / r.seconds for r in run.rounds])
        errors = sum(r.errors for r in run.rounds)
        results[mode] = {
            "wall_s_median": wall,
            "ttft_p50_s_median": ttft,
            "completion_tokens_per_s_median": rate,
            "errors": errors,
            "llama_server_threads": run.threads,
            "warned": run.warned,
            "load_average_1m": run.load,
            "rounds": [vars(r) for r in run.rounds],
        }
        threads = "/".join("-" if t is None else str(t) for t in run.threads)
        warned = "/".join("yes" if w else "no" for w in run.warned)
        load = f"{run.load[0]:.1f}-{run.load[1]:.1f}"
        rows.append([mode, threads, warned, wall, ttft, rate, errors, load])
    old, new = results.get("old"), results.get("new")
    if isinstance(old, dict) and isinstance(new, dict):
        results["old_over_new"] = {
            "wall_s": old["wall_s_median"] / new["wall_s_median"],
            "ttft_p50_s": old["ttft_p50_s_median"] / new["ttft_p50_s_median"],
            "tokens_per_s_new_over_old": (
                new["completion_tokens_per_s_median"] / old["completion_tokens_per_s_median"]
            ),
        }
    print_table(
        f"Workers on one host ({cores} usable cores): {args.requests} chats of {args.max_tokens} "
        f"tokens at once, medians of {args.rounds} rounds",
        ["mode", "threads", "warned", "wall s", "TTFT p50 s", "tok/s", "errors", "load 1m"],
        rows,
    )
    if "old_over_new" in results:
        print(f"old/new: {results['old_over_new']}")
    write_json("workers_one_host", {"config": vars(args), "cores": cores, "results": results})


if __name__ == "__main__":
    main()
