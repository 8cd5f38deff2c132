"""What knowing every streamed token's id costs (issue 16): llama-server with and without the
one post-sampling probability per token the worker asks for, and the worker's own work per
chunk (parse, ``TokenTrail.follow``, strip, serialise).

One llama-server (the default model, 1 slot); rounds alternate which kind of stream goes
first, so drift on this noisy machine hits both.

    python benchmarks/token_trail.py --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import aiohttp
import orjson

from common import free_port, median, print_table, processes, wait_http, write_json

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
from shoal.llama_cpp.locate import resolve  # noqa: E402
from shoal.models.default import DEFAULT_MODEL  # noqa: E402
from shoal.models.resolve import resolve_model  # noqa: E402
from shoal.protocol.messages import Endpoint  # noqa: E402
from shoal.settings import CommonSettings  # noqa: E402
from shoal.worker.text.resume.continuation import TokenTrail, with_token_ids  # noqa: E402

BODY = {
    "model": "bench",
    "stream": True,
    "temperature": 0,
    "ignore_eos": True,
    "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
}


async def stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, object]
) -> tuple[float, list[str]]:
    """Tokens per second of one stream (first to last content chunk), and its payloads."""
    payloads: list[str] = []
    times: list[float] = []
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                payloads.append(line[6:].strip().decode())
                if b'"content":"' in line:
                    times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0]), payloads


def worker_cost_us(payloads: list[str], repeat: int = 20) -> float:
    """The worker's added work per chunk: parse, follow, strip, serialise (microseconds)."""
    t0 = time.perf_counter()
    for _ in range(repeat):
        trail = TokenTrail(strip=True, chat=True)
        for data in payloads:
            chunk = orjson.loads(data)
            trail.follow(chunk)
            orjson.dumps(chunk).decode()
    return (time.perf_counter() - t0) / (repeat * len(payloads)) * 1e6


async def main(rounds: int, tokens: int) -> None:
    cache = CommonSettings().cache_dir
    binary = resolve(explicit=None, cache_dir=cache, path_env=None, allow_build=False)
    model = resolve_model(DEFAULT_MODEL.id, cache, download=False).path
    port = free_port()
    with processes(Path("/tmp/shoal-bench-token-trail")) as procs:
        procs.start(
            "llama-server",
            [str(binary.llama_server), "-m", str(model), "--port", str(port), "-np", "1"]
            + ["-c", "2048", "--threads", "2", "--no-webui", "--alias", "bench"],
        )
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        plain = {**BODY, "max_tokens": tokens}
        trailed = with_token_ids(plain, Endpoint.CHAT)
        rates: dict[str, list[float]] = {"plain": [], "ids": []}
        cost: list[float] = []
        connector = aiohttp.TCPConnector(force_close=True)  # llama-server closes after a stream
        async with aiohttp.ClientSession(connector=connector) as session:
            await stream(session, url + "/v1/chat/completions", plain)  # warm-up
            for r in range(rounds):
                order = [("plain", plain), ("ids", trailed)]
                for kind, body in order if r % 2 == 0 else order[::-1]:
                    rate, payloads = await stream(session, url + "/v1/chat/completions", body)
                    rates[kind].append(rate)
                    if kind == "ids":
                        cost.append(worker_cost_us(payloads))
    plain_rate, ids_rate = median(rates["plain"]), median(rates["ids"])
    print_table(
        f"token ids for resuming, {rounds} rounds of {tokens} tokens (medians)",
        ["stream", "tokens/s", "ratio"],
        [["plain", plain_rate, 1.0], ["with ids", ids_rate, ids_rate / plain_rate]],
    )
    print(f"worker per chunk (parse, follow, strip, serialise): {median(cost):.1f} us")
    write_json(
        "token_trail",
        {
            "rounds": rounds,
            "tokens": tokens,
            "tokens_per_s": {"plain": plain_rate, "ids": ids_rate},
            "ratio": ids_rate / plain_rate,
            "worker_us_per_chunk": median(cost),
            "samples": rates,
        },
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.tokens))
