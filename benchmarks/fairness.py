"""Fairness: a light key's latency while a heavy key floods the queue, fifo against fair.

One worker running its own llama-server (the default model, 4 slots; started per mode, so
that its answers report token ids and can be paused and go on: ``--preempt``, the default
with ``fair``) serves a router started once per mode (``--scheduling fifo``, then ``fair``),
each with its own key database holding two keys. Key A keeps ``--flood`` requests of
``--flood-tokens`` tokens in flight (closed loop: each one sent again as it ends,
``ignore_eos``); once its queue is full, key B sends ``--light`` short requests one after
another. Reported: B's latency alone (before any flood), B's latency under the flood in each
mode, and A's tokens/s from B's first request over ``--window`` seconds (longer if B's
requests take longer), counting A's answers that end in that stretch.

    python benchmarks/fairness.py
    python benchmarks/fairness.py --redis-url redis://127.0.0.1:6379/0

With ``--redis-url`` each mode runs two routers sharing that Redis (a key prefix of their
own, deleted afterwards): the worker connects to the first and key A floods it, key B
asks the second, so B's requests are ordered against A's by the fairness state in Redis.

Targets (issue 14): B's p50 under flood with fair >= 10x lower than with fifo, and within
(B alone + the time one of A's requests takes); A's throughput with fair >= 0.95x fifo's.
Also reported: how many of A's answers were paused for B's requests.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from common import free_port, median, pct, print_table, processes, wait_http, write_json

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
from shoal.keys import Scope, open_store  # noqa: E402
from shoal.llama_cpp.locate import resolve  # noqa: E402
from shoal.models.default import DEFAULT_MODEL  # noqa: E402
from shoal.models.resolve import resolve_model  # noqa: E402
from shoal.settings import CommonSettings  # noqa: E402

MODEL = "bench"


def body(tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Count from one to one thousand in words."}],
    }


@dataclass
class Run:
    light_ms: list[float] = field(default_factory=list)
    heavy_tokens: int = 0
    heavy_seconds: float = 0.0
    preempted: float = 0.0
    """Key A's answers paused for key B's requests (``--preempt``, fair only)."""


async def light_requests(client: httpx.AsyncClient, key: str, n: int, tokens: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await client.post(
            "/v1/chat/completions", json=body(tokens), headers={"Authorization": f"Bearer {key}"}
        )
        r.raise_for_status()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


async def measure(
    router: str, heavy: str, light: str, args: argparse.Namespace, light_router: str
) -> Run:
    run = Run()
    stop = asyncio.Event()
    ended: list[tuple[float, int]] = []  # (when, completion tokens) of each of A's answers
    limits = httpx.Limits(max_connections=args.flood + 8, max_keepalive_connections=args.flood + 8)
    async with (
        httpx.AsyncClient(base_url=router, timeout=600, limits=limits) as client,
        httpx.AsyncClient(base_url=light_router, timeout=600) as light_client,
    ):

        async def flood_one() -> None:
            while not stop.is_set():
                r = await client.post(
                    "/v1/chat/completions",
                    json=body(args.flood_tokens),
                    headers={"Authorization": f"Bearer {heavy}"},
                )
                r.raise_for_status()
                if not stop.is_set():
                    ended.append((time.perf_counter(), r.json()["usage"]["completion_tokens"]))

        async def queued() -> int:
            r = await client.get("/v1/models", headers={"Authorization": f"Bearer {light}"})
            return int(next(m["queued"] for m in r.json()["data"] if m["id"] == MODEL))

        async with asyncio.TaskGroup() as tg:
            floods = [tg.create_task(flood_one()) for _ in range(args.flood)]
            while await queued() < args.flood - args.slots:  # the flood is waiting
                await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            run.light_ms = await light_requests(light_client, light, args.light, args.light_tokens)
            # A's rate over the same stretch in both modes: at least --window seconds from
            # B's first request. Measured over B's requests alone, fair's window would be a
            # few seconds, where the answers that happen to end and the slot B holds weigh
            # as much as the flood; fifo's window would be minutes.
            await asyncio.sleep(max(0.0, t0 + args.window - time.perf_counter()))
            t1 = time.perf_counter()
            run.heavy_seconds = t1 - t0
            run.heavy_tokens = sum(n for when, n in ended if t0 <= when <= t1)
            run.preempted = await preempted(client, light)
            stop.set()
            for task in floods:
                task.cancel()
    return run


async def preempted(client: httpx.AsyncClient, key: str) -> float:
    """The router's ``shoal_jobs_preempted_total`` for the model."""
    r = await client.get("/metrics", headers={"Authorization": f"Bearer {key}"})
    line = f'shoal_jobs_preempted_total{{model="{MODEL}"}} '
    return sum(float(x[len(line) :]) for x in r.text.splitlines() if x.startswith(line))


def keys(folder: Path) -> tuple[str, str, str]:
    """A key database of its own with a heavy and a light key: (url, heavy, light)."""
    url = f"sqlite:///{folder / 'shoal.db'}"
    store = open_store(url)
    try:
        _, heavy = store.create(Scope.INFERENCE, "heavy")
        _, light = store.create(Scope.INFERENCE, "light")
    finally:
        store.close()
    return url, heavy, light


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flood", type=int, default=32, help="key A's requests in flight")
    parser.add_argument("--flood-tokens", type=int, default=128)
    parser.add_argument("--light", type=int, default=10, help="key B's requests, one by one")
    parser.add_argument("--light-tokens", type=int, default=16)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument(
        "--window",
        type=float,
        default=60.0,
        help="A's tokens/s is measured over at least this many seconds from B's first request",
    )
    parser.add_argument("--redis-url", help="two routers sharing this Redis (see above)")
    args = parser.parse_args()

    cache = CommonSettings().cache_dir
    binary = resolve(explicit=None, cache_dir=cache, path_env=None, allow_build=False)
    model = resolve_model(DEFAULT_MODEL.id, cache, download=False)
    logs = Path(__file__).parent / "results" / "logs" / "fairness"
    runs: dict[str, Run] = {}
    alone: list[float] = []
    with processes(logs) as procs, tempfile.TemporaryDirectory() as tmp:
        for mode in ("fifo", "fair"):
            url, heavy, light = keys(Path(tempfile.mkdtemp(dir=tmp)))
            prefix = f"shoal-bench-fairness-{uuid.uuid4().hex[:8]}:"
            shared = ("--redis-url", args.redis_url, "--redis-prefix", prefix)
            routers = []
            for n in range(2 if args.redis_url else 1):
                port = free_port()
                routers.append((port, f"http://127.0.0.1:{port}"))
                procs.shoal(
                    f"router-{mode}-{n}",
                    *("router", "--port", str(port), "--database-url", url, "--scheduling", mode),
                    *("--max-wait", "600", "--log-level", "warning"),
                    *(shared if args.redis_url else ()),
                )
                wait_http(routers[-1][1] + "/health")
            (port, router), (_, light_router) = routers[0], routers[-1]
            procs.shoal(
                f"worker-{mode}",
                *("worker", "--router-url", f"127.0.0.1:{port}", "--model-path", str(model.path)),
                *("--llama-server-path", str(binary.llama_server), "--model-alias", MODEL),
                *("--slots", str(args.slots), "--ctx-size", str(1024 * args.slots)),
                *("--log-level", "warning"),
            )
            wait_ready(light_router, light)
            if not alone:
                print(f"key B alone: {args.light} requests of {args.light_tokens} tokens ...")
                alone = asyncio.run(light_alone(light_router, light, args))
            print(f"{mode}: key A keeps {args.flood} x {args.flood_tokens} tokens in flight ...")
            runs[mode] = asyncio.run(measure(router, heavy, light, args, light_router))
            procs.stop_named(f"worker-{mode}")
            for n in range(len(routers)):
                procs.stop_named(f"router-{mode}-{n}")
            if args.redis_url:
                drop_prefix(args.redis_url, prefix)
    report(args, alone, runs)


def drop_prefix(url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(match=prefix + "*", count=500):
            client.unlink(key)
    finally:
        client.close()


async def light_alone(router: str, light: str, args: argparse.Namespace) -> list[float]:
    async with httpx.AsyncClient(base_url=router, timeout=600) as client:
        await light_requests(client, light, 2, args.light_tokens)  # warm the prompt cache
        return await light_requests(client, light, args.light, args.light_tokens)


def wait_ready(router: str, key: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(router + "/v1/models", headers={"Authorization": f"Bearer {key}"})
            if any(m["id"] == MODEL for m in r.json()["data"]):
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"no worker served {MODEL} within {timeout} s")


def report(args: argparse.Namespace, alone: list[float], runs: dict[str, Run]) -> None:
    rows = [["B alone", median(alone), pct(alone, 95), "", ""]]
    results: dict[str, object] = {"light_alone_p50_ms": median(alone)}
    for mode, run in runs.items():
        rate = run.heavy_tokens / run.heavy_seconds if run.heavy_seconds else float("nan")
        paused = f"{run.preempted:.0f} A answers paused"
        rows.append(
            [f"B under flood, {mode}", median(run.light_ms), pct(run.light_ms, 95), rate, paused]
        )
        results[mode] = {
            "light_p50_ms": median(run.light_ms),
            "light_p95_ms": pct(run.light_ms, 95),
            "light_ms": run.light_ms,
            "heavy_tokens_per_s": rate,
            "heavy_answers_paused": run.preempted,
        }
    fifo, fair = runs["fifo"], runs["fair"]
    speedup = median(fifo.light_ms) / median(fair.light_ms)
    throughput = (fair.heavy_tokens / fair.heavy_seconds) / (fifo.heavy_tokens / fifo.heavy_seconds)
    rows.append(["fifo p50 / fair p50", speedup, "", "", "target >= 10x"])
    rows.append(["A tok/s fair / fifo", throughput, "", "", "target >= 0.95x"])
    results |= {"light_p50_fifo_over_fair": speedup, "heavy_throughput_fair_over_fifo": throughput}
    where = ", two routers on Redis" if args.redis_url else ""
    print_table(
        f"Fairness: key A floods {args.flood} x {args.flood_tokens} tokens, key B asks "
        f"{args.light} x {args.light_tokens} tokens ({args.slots} slots{where})",
        ["", "B p50 ms", "B p95 ms", "A tok/s", ""],
        rows,
    )
    name = "fairness-redis" if args.redis_url else "fairness"
    write_json(name, {"config": vars(args), "results": results})


if __name__ == "__main__":
    main()
