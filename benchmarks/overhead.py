"""Overhead: the same streamed prompts straight to llama-server and through router + worker.

One real llama-server (the default model, 4 slots) serves both paths. With ``--backend own``
(the default: what ``shoal worker`` and ``shoal up`` do) the worker starts it itself, so every
job goes through the per-job features users get: slot pinning (``/apply-template`` and
``/tokenize`` on loopback, ``worker/pinning.py``) and token ids in the stream (``n_probs``
asked for and stripped again, ``worker/continuation.py``); the direct path posts the plain
client request to that same llama-server (its address as the router lists it). With
``--backend attached`` the benchmark starts llama-server and the worker attaches to it with
``--backend-url``, which skips both features: what is left is Shoal's relay alone. Rounds
alternate between the paths (and which goes first) so drift on this noisy machine hits both.
Stream i of a round always sends prompt i, so after the warm-up every request finds its
prompt in llama-server's cache: a cold prompt costs ~100 ms here and would decide the TTFT
median by which path happened to see a prompt first.

    python benchmarks/overhead.py --rounds 12                       # the users' path
    python benchmarks/overhead.py --rounds 12 --backend attached    # the relay alone

Targets (issue 2): added TTFT p50 <= 2 ms, added inter-chunk gap p50 <= 0.3 ms,
throughput >= 0.98x direct. Measured (medians of 5 runs, 2 cores at load ~1.2): own adds
3.3 ms TTFT at 1 stream, 8.4 ms at 4 (from 3.8 to 15 ms), 0.02 and 0.39 ms gap, 0.997x and
0.986x throughput; attached adds 2.1 and 0.0 ms, 0.02 and 0.24 ms, 0.990x and 0.989x.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
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

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
from shoal.llama_cpp.locate import resolve  # noqa: E402
from shoal.models.default import DEFAULT_MODEL  # noqa: E402
from shoal.models.resolve import resolve_model  # noqa: E402
from shoal.settings import CommonSettings  # noqa: E402

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "What is the capital of France and why is it famous?",
    "Describe a cat to someone who has never seen one.",
    "Give advice to a new programmer.",
    "Summarise the plot of a fairy tale.",
    "Why do leaves change colour in autumn?",
]


SLOTS = 4
CTX_PER_SLOT = 2048


def own_llama_server(router_url: str) -> str:
    """The address of the llama-server the router's one worker started, as the router lists
    it (``backend_url`` in ``/api/v1/workers``, kept current as the worker reports it)."""
    [worker] = httpx.get(router_url + "/api/v1/workers", timeout=5).json()["data"]
    return str(worker["backend_url"])


@dataclass
class Samples:
    ttft_ms: list[float] = field(default_factory=list)
    gaps_ms: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    reconnects: int = 0


async def one(
    session: aiohttp.ClientSession, url: str, prompt: str, tokens: int, out: Samples
) -> int:
    body = {
        "model": "bench",
        "stream": True,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": prompt}],
    }
    for attempt in range(3):
        try:
            return await _one(session, url, body, out)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
            # A pooled connection the server had already closed: count it, try once more.
            out.reconnects += 1
            print(f"reconnect to {url} after {exc!r}", flush=True)
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


async def _one(
    session: aiohttp.ClientSession, url: str, body: dict[str, object], out: Samples
) -> int:
    t0 = time.perf_counter()
    last = 0.0
    count = 0
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if b'"content":"' not in line:
                continue  # role header and the final empty delta carry no token
            if count == 0:
                out.ttft_ms.append((now - t0) * 1e3)
            else:
                out.gaps_ms.append((now - last) * 1e3)
            last = now
            count += 1
    return count


async def round_(
    session: aiohttp.ClientSession,
    url: str,
    concurrency: int,
    tokens: int,
    offset: int,
    out: Samples,
) -> None:
    t0 = time.perf_counter()
    counts = await asyncio.gather(
        *(
            one(session, url, PROMPTS[(offset + i) % len(PROMPTS)], tokens, out)
            for i in range(concurrency)
        )
    )
    out.tokens_per_s.append(sum(counts) / (time.perf_counter() - t0))


async def measure(
    urls: dict[str, str], concurrency: int, rounds: int, tokens: int
) -> dict[str, Samples]:
    samples = {name: Samples() for name in urls}
    names = list(urls)
    connector = aiohttp.TCPConnector(keepalive_timeout=3)  # llama-server closes idle ones at 5 s
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as session:
        for name in names:  # warm both paths (prompt cache, connections)
            await round_(session, urls[name], concurrency, 8, 0, Samples())
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                await round_(session, urls[name], concurrency, tokens, 0, samples[name])
    return samples


def summarize(s: Samples) -> dict[str, float]:
    return {
        "ttft_p50_ms": median(s.ttft_ms),
        "ttft_p99_ms": pct(s.ttft_ms, 99),
        "gap_p50_ms": median(s.gaps_ms),
        "gap_p99_ms": pct(s.gaps_ms, 99),
        "tokens_per_s_median": median(s.tokens_per_s),
        "requests": len(s.ttft_ms),
        "reconnects": s.reconnects,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument(
        "--llama-threads",
        type=int,
        default=1,
        help="llama-server threads. With every core busy computing (a CPU-only box; a GPU "
        "leaves them free) the relay waits for a time slice and the benchmark measures the "
        "scheduler, not Shoal, so by default one core is left for client and relay.",
    )
    parser.add_argument(
        "--backend",
        choices=["own", "attached"],
        default="own",
        help="own: the worker starts llama-server (slot pinning and token ids on every job, "
        "as users run it); attached: the worker attaches to one the benchmark starts (the "
        "relay alone).",
    )
    parser.add_argument(
        "--worker-log-level",
        default="warning",
        help="The worker's log level (debug logs each job's slot and tokenize time).",
    )
    args = parser.parse_args()

    cache = CommonSettings().cache_dir
    binary = resolve(explicit=None, cache_dir=cache, path_env=None, allow_build=False)
    model = resolve_model(DEFAULT_MODEL.id, cache, download=False)
    router_port = free_port()
    router = f"http://127.0.0.1:{router_port}"
    logs = Path(__file__).parent / "results" / "logs" / "overhead"
    results: dict[str, dict[str, dict[str, float]]] = {}
    load_before = os.getloadavg()
    with processes(logs) as procs:
        procs.shoal("router", "router", "--port", str(router_port), "--log-level", "warning")
        worker_args = [
            "worker",
            "--router-url",
            f"127.0.0.1:{router_port}",
            "--model-alias",
            "bench",
            "--slots",
            str(SLOTS),
            "--log-level",
            args.worker_log_level,
        ]
        if args.backend == "attached":
            llama_port = free_port()
            direct = f"http://127.0.0.1:{llama_port}"
            procs.start(
                "llama-server",
                [
                    str(binary.llama_server),
                    "-m",
                    str(model.path),
                    "--alias",
                    "bench",
                    "--port",
                    str(llama_port),
                    "-np",
                    str(SLOTS),
                    "-c",
                    str(CTX_PER_SLOT * SLOTS),
                    "--no-webui",
                    "--threads",
                    str(args.llama_threads),
                ],
            )
            wait_http(direct + "/health")
            procs.shoal("worker", *worker_args, "--backend-url", direct)
        else:
            procs.shoal(
                "worker",
                *worker_args,
                "--model",
                str(model.path),
                "--ctx-size",
                str(CTX_PER_SLOT),
                "--threads",
                str(args.llama_threads),
            )
        wait_workers(router, 1)
        if args.backend == "own":
            direct = own_llama_server(router)
        urls = {
            "direct": direct + "/v1/chat/completions",
            "router": router + "/v1/chat/completions",
        }
        for c in args.concurrency:
            print(
                f"concurrency {c}: {args.rounds} rounds of {c} x {args.tokens} tokens per path ...",
                flush=True,
            )
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                samples = runner.run(measure(urls, c, args.rounds, args.tokens))
            results[f"c{c}"] = {name: summarize(s) for name, s in samples.items()}
    load_after = os.getloadavg()
    rows = []
    for key, pair in results.items():
        d, r = pair["direct"], pair["router"]
        added = {
            "added_ttft_p50_ms": r["ttft_p50_ms"] - d["ttft_p50_ms"],
            "added_gap_p50_ms": r["gap_p50_ms"] - d["gap_p50_ms"],
            "throughput_ratio": r["tokens_per_s_median"] / d["tokens_per_s_median"],
        }
        pair["added"] = added
        for name in ("direct", "router"):
            s = pair[name]
            rows.append(
                [
                    key,
                    name,
                    s["ttft_p50_ms"],
                    s["ttft_p99_ms"],
                    s["gap_p50_ms"],
                    s["gap_p99_ms"],
                    s["tokens_per_s_median"],
                    "",
                ]
            )
        rows.append(
            [
                key,
                "added / ratio",
                added["added_ttft_p50_ms"],
                "",
                added["added_gap_p50_ms"],
                "",
                "",
                f"{added['throughput_ratio']:.3f}x",
            ]
        )
    print_table(
        f"Overhead of router + worker ({args.backend} llama-server) over llama-server "
        "(targets: added TTFT p50 <= 2 ms, added gap p50 <= 0.3 ms, throughput >= 0.98x); "
        f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}",
        [
            "conc",
            "path",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "gap p50 ms",
            "gap p99 ms",
            "tok/s (median round)",
            "ratio",
        ],
        rows,
    )
    write_json(
        "overhead",
        {
            "config": vars(args),
            "backend": args.backend,
            "load_average": {"before": load_before, "after": load_after},
            "results": results,
            "targets": {
                "added_ttft_p50_ms": 2.0,
                "added_gap_p50_ms": 0.3,
                "throughput_ratio": 0.98,
            },
        },
    )


if __name__ == "__main__":
    main()
