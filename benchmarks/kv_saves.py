"""A model's slots' KV caches saved before eviction and restored after reload
(``worker/text/residency/kv_saves.py``): what it costs and what the returning turn gains.

For each system prompt size (``--rules``: 40 rules are about 680 prompt tokens, 120 about
2,000): one llama-server of the default model (2 slots, ``--threads``), a first turn pinned to
a slot as the worker pins it, ``SlotSaves.save`` (the pass's wall time, llama-server's
``save_ms``, the file's bytes), the server stopped; then ``--runs`` times a fresh llama-server
either restored (``SlotSaves.restore``: wall time and ``restore_ms``) or not, and the same
conversation plus one more turn, streamed: its time to first token and ``cache_n``. Medians.

    python benchmarks/kv_saves.py
    python benchmarks/kv_saves.py --rules 40 --runs 7
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai

from common import median, print_table, write_json

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
from shoal.llama_cpp.locate import resolve  # noqa: E402
from shoal.models.default import DEFAULT_MODEL  # noqa: E402
from shoal.models.resolve import resolve_model  # noqa: E402
from shoal.protocol.ids import JobId, ModelName  # noqa: E402
from shoal.protocol.messages import BackendState, Endpoint, JobStart  # noqa: E402
from shoal.settings import CommonSettings  # noqa: E402
from shoal.units import GIB  # noqa: E402
from shoal.worker.text import loopback  # noqa: E402
from shoal.worker.text.llama_server import LlamaServer, LlamaServerConfig  # noqa: E402
from shoal.worker.text.pinning import SlotPinning  # noqa: E402
from shoal.worker.text.residency.kv_saves import SlotSaves  # noqa: E402
from shoal.worker.text.slots import SlotTable  # noqa: E402

MODEL = "smol"


@asynccontextmanager
async def running(config: LlamaServerConfig) -> AsyncIterator[LlamaServer]:
    ready = asyncio.Event()

    def on_state(state: BackendState, detail: str) -> None:
        if state is BackendState.READY:
            ready.set()

    server = LlamaServer(config, on_state)
    task = asyncio.create_task(server.run())
    try:
        async with asyncio.timeout(120):
            await ready.wait()
        yield server
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def turn(
    pinning: SlotPinning, url: str, messages: list[dict[str, str]]
) -> tuple[str, float, int, int]:
    """A streamed chat pinned as the worker pins it: its text, TTFT, prompt and cached tokens."""
    job = JobStart(
        job_id=JobId(f"b{time.monotonic_ns()}"),
        model=ModelName(MODEL),
        endpoint=Endpoint.CHAT,
        stream=True,
        body={"messages": messages},
    )
    async with (
        pinning.pin(job) as pin,
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client,
    ):
        assert pin is not None
        started = time.perf_counter()
        ttft = float("nan")
        text, prompt_n, cache_n = "", 0, 0
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"id_slot": pin.slot},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft != ttft:  # nan: the first
                    ttft = time.perf_counter() - started
                text += chunk.choices[0].delta.content
            timings = (chunk.model_extra or {}).get("timings")
            if isinstance(timings, dict):
                prompt_n = int(timings.get("prompt_n", 0)) + int(timings.get("cache_n", 0))
                cache_n = int(timings.get("cache_n", 0))
        return text, ttft, prompt_n, cache_n


async def one_size(
    config: LlamaServerConfig, saves: SlotSaves, rules: int, runs: int
) -> dict[str, Any]:
    system = " ".join(
        f"Rule {i}: always answer politely and briefly, citing rule {i}." for i in range(rules)
    )
    first = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Hello there, which rule comes first?"},
    ]
    async with loopback.session() as session:
        table = SlotTable(config.slots, lambda _: None)
        async with running(config) as server:
            pinning = SlotPinning(table, session, lambda: server.url)
            answer, _, prompt_tokens, _ = await turn(pinning, server.url, first)
            started = time.perf_counter()
            saved = await saves.save(session, server.url, config, table)
            save_wall = time.perf_counter() - started
        [save] = saved
        back = [*first, {"role": "assistant", "content": answer}]
        back.append({"role": "user", "content": "And the second rule?"})
        rows: dict[str, list[dict[str, float]]] = {"restored": [], "recomputed": []}
        for _ in range(runs):
            for mode in ("restored", "recomputed"):
                table = SlotTable(config.slots, lambda _: None)
                async with running(config) as server:
                    restore_wall = restore_ms = 0.0
                    if mode == "restored":
                        started = time.perf_counter()
                        [r] = await saves.restore(session, server.url, config, table)
                        restore_wall = time.perf_counter() - started
                        restore_ms = r.seconds * 1000
                    pinning = SlotPinning(table, session, lambda: server.url)
                    _, ttft, n, cached = await turn(pinning, server.url, back)
                rows[mode].append(
                    {
                        "ttft_ms": ttft * 1000,
                        "prompt_tokens": n,
                        "cached_tokens": cached,
                        "restore_wall_ms": restore_wall * 1000,
                        "restore_ms": restore_ms,
                    }
                )
    out: dict[str, Any] = {
        "rules": rules,
        "first_turn_prompt_tokens": prompt_tokens,
        "saved_tokens": save.tokens,
        "file_bytes": save.bytes,
        "save_ms": save.seconds * 1000,
        "save_pass_wall_ms": save_wall * 1000,
        "runs": rows,
    }
    for mode, got in rows.items():
        out[f"{mode}_ttft_ms_median"] = median([g["ttft_ms"] for g in got])
        out[f"{mode}_cached_median"] = median([g["cached_tokens"] for g in got])
    out["restore_ms_median"] = median([g["restore_ms"] for g in rows["restored"]])
    out["restore_pass_wall_ms_median"] = median([g["restore_wall_ms"] for g in rows["restored"]])
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", type=int, nargs="+", default=[40, 120])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="kv-saves")
    args = parser.parse_args()
    cache = CommonSettings().cache_dir
    binary = resolve(explicit=None, cache_dir=cache, path_env=None, allow_build=False).llama_server
    model = resolve_model(DEFAULT_MODEL.id, cache, download=False).path
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        saves = SlotSaves(Path(tmp) / "kv-saves", 4 * GIB)
        for rules in args.rules:
            config = LlamaServerConfig(
                binary=binary,
                model_path=model,
                alias=MODEL,
                slots=2,
                ctx_size=4096,
                log_file=Path(tmp) / "llama-server.log",
                threads=args.threads,
                max_restarts=0,
            )
            config = dataclasses.replace(config, slot_save_path=saves.folder(config))
            results.append(await one_size(config, saves, rules, args.runs))
    print_table(
        f"KV cache saved and restored (median of {args.runs}; default model, "
        f"{args.threads} threads)",
        [
            "prompt tok",
            "file MiB",
            "save ms",
            "save pass ms",
            "restore ms",
            "restore pass ms",
            "TTFT restored ms",
            "TTFT recomputed ms",
            "cached",
        ],
        [
            [
                r["first_turn_prompt_tokens"],
                r["file_bytes"] / (1 << 20),
                r["save_ms"],
                r["save_pass_wall_ms"],
                r["restore_ms_median"],
                r["restore_pass_wall_ms_median"],
                r["restored_ttft_ms_median"],
                r["recomputed_ttft_ms_median"],
                f"{r['restored_cached_median']:.0f} vs {r['recomputed_cached_median']:.0f}",
            ]
            for r in results
        ],
    )
    write_json(args.name, {"threads": args.threads, "runs": args.runs, "sizes": results})


if __name__ == "__main__":
    asyncio.run(main())
