"""Several models on one worker: loads, evictions, and conversations that come back after
their model was evicted.

One router and one worker serving ``--models`` (3) models, each a copy of the default model's
GGUF under its own name (``m1``, ``m2``…: real llama-servers, real loads and evictions), with
``--slots`` (2) slots each and a ``--memory-budget`` (``--budget-mib``, 500 MiB) that holds two
of them but not three. ``--conversations`` (2) conversations per model, each a system prompt
of about 1,000 tokens of its own and ``--turns`` (4) short turns, are sent one request at a
time in a seeded random order that keeps each conversation's turns in order: a model is
evicted whenever the other two were used since, and its conversations come back to it.

Each request is put in one class by what the worker reported just before it was sent:

- ``new``: a conversation's first turn, its model loaded;
- ``resident``: a returning turn whose model stayed loaded since its last turn;
- ``restored``: a returning turn whose model was evicted since its last turn and is loaded
  again (another request loaded it): what it reuses came back from the saved KV cache;
- ``loading``: its model is not loaded, so this request waits for the load (TTFT includes it).

Everything runs twice: with the KV cache saved before an eviction and restored after
(``saves``), and with saving off (``--kv-save-limit 0``: ``cold``), so the cold figure for the
same turns stands beside it.

Reported per mode and model: loads, evictions, TTFT p50/p90 per class, the prompt tokens a
returning turn reused (``usage.prompt_tokens_details.cached_tokens``) over its previous turn's
prompt, failed requests; the most bytes the worker reported resident at once (polled every
0.2 s, against its budget); and thrash events: a model loaded while a request for another
model ran (with one request at a time, every load must be the request's own).

Targets (issue 27): no failed request; never more bytes resident than the budget; a returning
conversation after an eviction (``restored``) reuses >= 0.9 of its prefix, and its TTFT p50
is within 1.5x of ``resident``'s; no thrash event.

    python benchmarks/multi_model.py
    python benchmarks/multi_model.py --turns 6 --seed 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from common import free_port, median, pct, print_table, processes, wait_http, write_json
from prefix_routing import WORDS

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
from shoal.llama_cpp.locate import resolve  # noqa: E402
from shoal.models.default import DEFAULT_MODEL  # noqa: E402
from shoal.models.resolve import resolve_model  # noqa: E402
from shoal.settings import CommonSettings  # noqa: E402

MODES = ("saves", "cold")
CLASSES = ("new", "resident", "restored", "loading")
MIB = 1024 * 1024


def system_prompt(conversation: int, words: int) -> str:
    rng = random.Random(conversation)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are assistant number {conversation}. Follow these instructions: {body}."


@dataclass
class Conversation:
    id: int
    model: str
    messages: list[dict[str, str]]
    turns: int = 0
    last_prompt_tokens: int = 0
    evictions_at_last_turn: int = 0


@dataclass
class Sample:
    k: int
    conversation: int
    model: str
    turn: int
    cls: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    previous_prompt_tokens: int
    error: str = ""


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    max_resident_bytes: int = 0
    budget_bytes: int | None = None
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    thrash: list[str] = field(default_factory=list)
    seconds: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)


async def worker_models(client: httpx.AsyncClient) -> tuple[dict[str, dict[str, Any]], int | None]:
    """The one worker's models as it last reported them, by name, and its budget."""
    data = (await client.get("/api/v1/workers")).json()["data"]
    worker = data[0]
    return {m["name"]: m for m in worker["models"]}, worker.get("model_budget_bytes")


def resident_bytes(models: dict[str, dict[str, Any]]) -> int:
    return sum(
        m.get("resident_bytes") or 0
        for m in models.values()
        if m.get("state") in ("ready", "loading")
    )


async def one(
    client: httpx.AsyncClient, conv: Conversation, max_tokens: int
) -> tuple[float, dict[str, Any], str]:
    body = {
        "model": conv.model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": conv.messages,
    }
    t0 = time.perf_counter()
    ttft = float("nan")
    usage: dict[str, Any] = {}
    text: list[str] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece:
                    if ttft != ttft:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
            if chunk.get("usage"):
                usage = chunk["usage"]
    return ttft, usage, "".join(text)


async def drive(
    router: str, order: list[int], convs: list[Conversation], args: argparse.Namespace
) -> Run:
    run = Run()
    async with httpx.AsyncClient(base_url=router, timeout=900) as client:
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                try:
                    models, budget = await worker_models(client)
                    run.budget_bytes = budget
                    run.max_resident_bytes = max(run.max_resident_bytes, resident_bytes(models))
                except (httpx.HTTPError, KeyError, IndexError, ValueError):
                    pass
                await asyncio.sleep(0.2)

        watcher = asyncio.create_task(watch())
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        for k, c in enumerate(order):
            await turn(client, run, k, convs[c], args.max_tokens)
        run.seconds = time.perf_counter() - t0
        run.load = (load_before, os.getloadavg()[0])
        stop.set()
        await watcher
        run.models, run.budget_bytes = await worker_models(client)
    return run


def classify(conv: Conversation, mine: dict[str, Any]) -> str:
    """The class of the next turn of ``conv`` (module docstring), ``mine``: its model now."""
    if mine.get("state") != "ready":
        return "loading"
    if conv.turns == 0:
        return "new"
    return "restored" if mine.get("evictions", 0) > conv.evictions_at_last_turn else "resident"


async def turn(
    client: httpx.AsyncClient, run: Run, k: int, conv: Conversation, max_tokens: int
) -> None:
    """Send the next turn of ``conv`` and record it."""
    before, _ = await worker_models(client)
    question = f"Turn {conv.turns + 1}: what is the status of order {k * 7}?"
    conv.messages.append({"role": "user", "content": question})
    sample = Sample(
        k,
        conv.id,
        conv.model,
        conv.turns + 1,
        classify(conv, before[conv.model]),
        float("nan"),
        0,
        0,
        conv.last_prompt_tokens,
    )
    run.samples.append(sample)
    try:
        ttft, usage, text = await one(client, conv, max_tokens)
    except (httpx.HTTPError, RuntimeError) as exc:
        sample.error = str(exc)
        conv.messages.pop()
        return
    after, _ = await worker_models(client)
    for name, m in after.items():
        if name != conv.model and m.get("loads", 0) > before[name].get("loads", 0):
            run.thrash.append(f"request {k} for {conv.model} saw {name} loaded")
    details = usage.get("prompt_tokens_details") or {}
    sample.ttft_s = ttft
    sample.prompt_tokens = int(usage.get("prompt_tokens", 0))
    sample.cached_tokens = int(details.get("cached_tokens", 0))
    conv.messages.append({"role": "assistant", "content": text})
    conv.turns += 1
    conv.last_prompt_tokens = sample.prompt_tokens
    conv.evictions_at_last_turn = after[conv.model].get("evictions", 0)


def models_file(folder: Path, source: Path, n: int, slots: int, ctx: int) -> Path:
    lines = []
    for i in range(1, n + 1):
        copy = folder / f"m{i}.gguf"
        if not copy.exists():
            shutil.copyfile(source, copy)
        lines += [
            "[[models]]",
            f'model = "{copy}"',
            f'alias = "m{i}"',
            f"slots = {slots}",
            f"ctx_size = {ctx}",
            "preload = false",
            "",
        ]
    path = folder / "models.toml"
    path.write_text("\n".join(lines))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=int, default=3)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--ctx-size", type=int, default=2048, help="per slot")
    parser.add_argument("--conversations", type=int, default=2, help="per model")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--words", type=int, default=700, help="system prompt words (~1k tokens)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--budget-mib", type=float, default=500)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()

    cache = CommonSettings().cache_dir
    binary = resolve(explicit=None, cache_dir=cache, path_env=None, allow_build=False)
    model = resolve_model(DEFAULT_MODEL.id, cache, download=False)
    n_convs = args.models * args.conversations
    rng = random.Random(args.seed)
    pending = [c for c in range(n_convs) for _ in range(args.turns)]
    rng.shuffle(pending)
    order = pending  # a conversation's turns go in order whatever positions it drew
    logs = Path(__file__).parent / "results" / "logs" / "multi_model"
    runs: dict[str, Run] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-multi-model-") as tmp:
        folder = Path(tmp)
        file = models_file(folder, model.path, args.models, args.slots, args.ctx_size)
        for mode in args.modes:
            convs = [
                Conversation(
                    c,
                    f"m{c // args.conversations + 1}",
                    [{"role": "system", "content": system_prompt(c, args.words)}],
                )
                for c in range(n_convs)
            ]
            with processes(logs) as procs:
                port = free_port()
                router = f"http://127.0.0.1:{port}"
                procs.shoal(
                    f"router-{mode}",
                    *("router", "--port", str(port), "--max-wait", "900", "--log-level", "warning"),
                )
                wait_http(router + "/health")
                procs.shoal(
                    f"worker-{mode}",
                    *("worker", "--router-url", f"127.0.0.1:{port}", "--name", "w"),
                    *("--llama-server-path", str(binary.llama_server)),
                    *("--models-file", str(file), "--memory-budget", str(args.budget_mib / 1024)),
                    *("--threads", str(args.threads), "--log-level", "info"),
                    *(("--kv-save-limit", "0") if mode == "cold" else ()),
                    *("--cache-dir", str(folder / f"cache-{mode}")),
                )
                wait_models(router, args.models)
                print(f"{mode}: {len(order)} requests over {n_convs} conversations ...")
                runs[mode] = asyncio.run(drive(router, order, convs, args))
    report(args, runs)


def wait_models(router: str, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = httpx.get(router + "/api/v1/workers", timeout=2).json()["data"]
            if data and len(data[0]["models"]) >= n and data[0]["state"] in ("ready", "unloaded"):
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the worker did not list {n} models within {timeout} s")


def report(args: argparse.Namespace, runs: dict[str, Run]) -> None:
    results: dict[str, Any] = {"args": vars(args)}
    rows: list[list[object]] = []
    for mode, run in runs.items():
        ok = [s for s in run.samples if not s.error]
        entry: dict[str, Any] = {
            "failed": len(run.samples) - len(ok),
            "errors": [s.error for s in run.samples if s.error][:5],
            "max_resident_bytes": run.max_resident_bytes,
            "budget_bytes": run.budget_bytes,
            "thrash_events": run.thrash,
            "seconds": run.seconds,
            "load_average_1m": run.load,
            "classes": {},
            "models": {
                name: {
                    k: m.get(k) for k in ("loads", "evictions", "load_seconds", "resident_bytes")
                }
                for name, m in run.models.items()
            },
            "samples": [vars(s) for s in run.samples],
        }
        for cls in CLASSES:
            mine = [s for s in ok if s.cls == cls]
            returning = [s for s in mine if s.previous_prompt_tokens]
            ttft = [s.ttft_s for s in mine]
            reused = (
                sum(min(s.cached_tokens, s.previous_prompt_tokens) for s in returning)
                / sum(s.previous_prompt_tokens for s in returning)
                if returning
                else float("nan")
            )
            entry["classes"][cls] = {
                "requests": len(mine),
                "ttft_p50_s": median(ttft) if ttft else float("nan"),
                "ttft_p90_s": pct(ttft, 90) if ttft else float("nan"),
                "reused_of_previous_prompt": reused,
            }
            rows.append(
                [
                    mode,
                    cls,
                    len(mine),
                    entry["classes"][cls]["ttft_p50_s"],
                    entry["classes"][cls]["ttft_p90_s"],
                    reused,
                ]
            )
        classes = entry["classes"]
        entry["restored_over_resident_ttft_p50"] = (
            classes["restored"]["ttft_p50_s"] / classes["resident"]["ttft_p50_s"]
        )
        results[mode] = entry
    print_table(
        f"Several models on one worker: {args.models} models x {args.slots} slots, budget "
        f"{args.budget_mib:g} MiB, {args.conversations} conversations per model x "
        f"{args.turns} turns",
        ["mode", "class", "requests", "TTFT p50 s", "TTFT p90 s", "reused/prev prompt"],
        rows,
    )
    model_rows = [
        [
            mode,
            name,
            m["loads"],
            m["evictions"],
            m["load_seconds"],
            (m["resident_bytes"] or 0) / MIB,
        ]
        for mode, run in runs.items()
        for name, m in sorted(results[mode]["models"].items())
    ]
    print_table(
        "Per model",
        ["mode", "model", "loads", "evictions", "last load s", "resident MiB"],
        model_rows,
    )
    summary = [
        [
            mode,
            results[mode]["failed"],
            results[mode]["max_resident_bytes"] / MIB,
            (results[mode]["budget_bytes"] or 0) / MIB,
            len(results[mode]["thrash_events"]),
            results[mode]["restored_over_resident_ttft_p50"],
        ]
        for mode in runs
    ]
    print_table(
        "Targets: 0 failed, max resident <= budget, 0 thrash, restored reuse >= 0.9 and "
        "TTFT p50 <= 1.5x resident",
        ["mode", "failed", "max resident MiB", "budget MiB", "thrash", "restored/resident TTFT"],
        summary,
    )
    write_json("multi_model", results)


if __name__ == "__main__":
    main()
