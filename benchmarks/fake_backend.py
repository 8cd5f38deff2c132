"""A FAKE OpenAI-compatible streaming server, for measuring Shoal's relay alone.

It generates no text: every stream gets ``max_tokens`` tiny chunks, one per tick, and each
chunk carries the wall-clock time it was written (``shoal_bench_ts``), so a client on the
same machine can tell how much delay the relay added between two chunks. One ticker drives
every open stream, like a batched inference server that emits a token for each sequence
per decode step.

    python benchmarks/fake_backend.py --port 9000 --interval-ms 25
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
from aiohttp import web

CHUNK = (
    '{{"id":"fake-{n}","object":"chat.completion.chunk","created":0,"model":"fake",'
    '"choices":[{{"index":0,"delta":{{"content":"tok"}},"finish_reason":null}}],'
    '"shoal_bench_ts":{ts:.6f}}}'
)


class Ticker:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.tick = asyncio.Event()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += self.interval
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            self.tick.set()
            self.tick = asyncio.Event()


async def chat(request: web.Request) -> web.StreamResponse:
    body = orjson.loads(await request.read())
    n = int(body.get("max_tokens") or 16)
    ticker: Ticker = request.app["ticker"]
    if not body.get("stream"):
        for _ in range(n):
            await ticker.tick.wait()
        return web.json_response(
            {
                "id": "fake",
                "object": "chat.completion",
                "created": 0,
                "model": "fake",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "length",
                        "message": {"role": "assistant", "content": "tok" * n},
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1},
            }
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(n):
        await ticker.tick.wait()
        await resp.write(b"data: " + CHUNK.format(n=i, ts=time.time()).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--interval-ms", type=float, default=25.0)
    args = parser.parse_args()

    async def start(app: web.Application) -> None:
        ticker = Ticker(args.interval_ms / 1000)
        app["ticker"] = ticker
        app["ticker_task"] = asyncio.create_task(ticker.run())

    app = web.Application()
    app.on_startup.append(start)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    import uvloop

    web.run_app(
        app,
        host="127.0.0.1",
        port=args.port,
        print=None,
        access_log=None,
        loop=uvloop.new_event_loop(),
    )


if __name__ == "__main__":
    main()
