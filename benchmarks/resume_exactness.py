"""Is a resumed answer exactly the uninterrupted one? (issue 16)

For several prompts (chat and completions), one llama-server (A) gives the uninterrupted
answer at temperature 0 with ``ignore_eos``; then, for many cut points (every ``--step``
tokens), another llama-server (B, "the next worker") goes on from the cut exactly as a
resumed job does (``Backend.run`` with a ``Continuation``: the original prompt followed by
the produced ids, as one prompt). B's slot is erased before each continuation and B keeps
no prompt cache, so it evaluates the whole prefix in batches as a fresh worker would.

Reported per prompt: the fraction of cuts whose whole answer (produced ids + continuation)
equals the uninterrupted ids, and for the others where the first differing token falls
(absolute position, and tokens after the cut).

    python benchmarks/resume_exactness.py --tokens 200 --step 8
    python benchmarks/resume_exactness.py --one-batch   # the prefix read back in one batch
    python benchmarks/resume_exactness.py --one-batch --b-args "-ub 32"   # ... of 32 at most
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

from common import free_port, median, print_table, processes, wait_http, write_json

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
from shoal.llama_cpp.locate import resolve  # noqa: E402
from shoal.models.default import DEFAULT_MODEL  # noqa: E402
from shoal.models.resolve import resolve_model  # noqa: E402
from shoal.protocol.ids import JobId, ModelName  # noqa: E402
from shoal.protocol.messages import Continuation, Endpoint, JobStart  # noqa: E402
from shoal.worker.jobs.sink import JobOutcome  # noqa: E402
from shoal.worker.text.backend import Backend, BackendTarget  # noqa: E402
from shoal.worker.text.resume import going_on as going_on_module  # noqa: E402

MODEL = "bench"
PROMPTS: list[tuple[str, Endpoint, Any]] = [
    ("chat-sea", Endpoint.CHAT, [{"role": "user", "content": "Write a poem about the sea."}]),
    (
        "chat-code",
        Endpoint.CHAT,
        [{"role": "user", "content": "Explain how a hash map works, with an example."}],
    ),
    ("text-village", Endpoint.COMPLETIONS, "Once upon a time, in a village by the sea,"),
    ("text-list", Endpoint.COMPLETIONS, "The ten largest cities in Europe are"),
]


class Sink:
    def __init__(self) -> None:
        self.chunks: list[tuple[dict[str, Any], tuple[int, ...] | None]] = []
        self.outcomes: list[JobOutcome] = []
        self.first: float | None = None

    def chunk(self, job_id: JobId, data: str, tokens: tuple[int, ...] | None = None) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self.chunks.append((orjson.loads(data), tokens))

    def send(self, message: JobOutcome, /) -> None:
        self.outcomes.append(message)

    def ids(self) -> list[int]:
        return [t for _, tokens in self.chunks for t in tokens or ()]


def job_for(endpoint: Endpoint, prompt: Any, tokens: int) -> JobStart:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    body["messages" if endpoint is Endpoint.CHAT else "prompt"] = prompt
    return JobStart(
        job_id=JobId("bench"), model=ModelName(MODEL), endpoint=endpoint, stream=True, body=body
    )


def cut_at(sink: Sink, n: int) -> tuple[int, ...] | None:
    """The ids a client had when the worker was lost once ``n`` ids were known (None: no
    chunk ends exactly there)."""
    ids: list[int] = []
    for _, tokens in sink.chunks:
        if tokens is None:
            continue
        ids += tokens
        if len(ids) == n:
            return tuple(ids)
        if len(ids) > n:
            return None
    return None


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def one_prompt(
    a: Backend, b: Backend, b_url: str, endpoint: Endpoint, prompt: Any, tokens: int, step: int
) -> dict[str, Any]:
    job = job_for(endpoint, prompt, tokens)
    whole = Sink()
    await a.run(job, whole)
    expected = whole.ids()
    assert len(expected) == tokens, f"{len(expected)} ids of {tokens}"
    cuts: list[dict[str, Any]] = []
    for n in range(step, tokens, step):
        produced = cut_at(whole, n)
        if produced is None:
            continue
        async with httpx.AsyncClient() as client:  # "another worker": nothing of this cached
            (await client.post(f"{b_url}/slots/0?action=erase")).raise_for_status()
        rest = Sink()
        resume = Continuation(tokens=produced)
        t0 = time.perf_counter()
        await b.run(job.model_copy(update={"resume": resume, "attempt": 2}), rest)
        first_s = (rest.first or float("nan")) - t0
        got = list(produced) + rest.ids()
        diff = first_difference(expected, got)
        cuts.append(
            {"cut": n, "exact": diff is None, "first_difference": diff, "first_chunk_s": first_s}
        )
    return {"tokens": expected, "cuts": cuts}


async def main(
    tokens: int, step: int, threads: int, b_args: str, only: str, one_batch: bool
) -> None:
    from shoal.settings import CommonSettings

    cache = CommonSettings().cache_dir
    binary = resolve(explicit=None, cache_dir=cache, path_env=None, allow_build=False)
    model = resolve_model(DEFAULT_MODEL.id, cache, download=False).path
    saves = tempfile.mkdtemp(prefix="shoal-bench-slots-")
    base = [str(binary.llama_server), "-m", str(model), "--alias", MODEL, "-np", "1"]
    base += ["-c", "2048", "--threads", str(threads), "--no-webui"]
    ports = free_port(), free_port()
    results: dict[str, Any] = {}
    with processes(Path("/tmp/shoal-bench-resume-exactness")) as procs:
        procs.start("llama-a", [*base, "--port", str(ports[0])])
        extra = ["--cache-ram", "0", "--slot-save-path", saves, *shlex.split(b_args)]
        procs.start("llama-b", [*base, "--port", str(ports[1]), *extra])
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url in urls:
            wait_http(url + "/health")
        async with aiohttp.ClientSession() as session:
            a, b = (
                Backend(BackendTarget(MODEL, token_ids=True), session, lambda u=u: u) for u in urls
            )
            for name, endpoint, prompt in PROMPTS:
                if only and name not in only.split(","):
                    continue
                results[name] = await one_prompt(a, b, urls[1], endpoint, prompt, tokens, step)
    rows = []
    for name, result in results.items():
        cuts = result["cuts"]
        wrong = [c for c in cuts if not c["exact"]]
        rows.append(
            [
                name,
                len(cuts),
                sum(c["exact"] for c in cuts) / len(cuts) if cuts else float("nan"),
                median([c["first_chunk_s"] for c in cuts]),
                max((c["first_chunk_s"] for c in cuts), default=float("nan")),
                " ".join(f"{c['cut']}>{c['first_difference']}" for c in wrong[:6]) or "-",
            ]
        )
    print_table(
        f"resume exactness: {tokens} tokens, a cut every {step}, B args {b_args!r}"
        + (", prefix in one batch" if one_batch else ", prefix in steps"),
        ["prompt", "cuts", "exact", "first chunk s (median)", "(max)", "cut>first difference"],
        rows,
    )
    write_json(
        "resume_exactness",
        {
            "tokens": tokens,
            "step": step,
            "threads": threads,
            "b_args": b_args,
            "one_batch": one_batch,
            "results": {k: v["cuts"] for k, v in results.items()},
        },
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--step", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--b-args", default="", help="extra llama-server flags for B")
    parser.add_argument("--only", default="", help="comma-separated prompt names")
    parser.add_argument(
        "--one-batch",
        action="store_true",
        help="no prefill steps: B reads the prompt and the produced ids in one request",
    )
    args = parser.parse_args()
    if args.one_batch:
        going_on_module.prefill_prompts = lambda prompt, produced, step=0: []
    asyncio.run(main(args.tokens, args.step, args.threads, args.b_args, args.only, args.one_batch))
