"""Redis job queue: per-job latency, jobs/s, and output events/s, against a real Redis.

Everything runs in this one Python process (uvloop): "clients" enqueue a job and read its
output with ``events`` (as the router a client called does), "consumers" claim jobs and
publish their output (as a router serving workers, or a pull worker, does). Each part has
its own Redis client, as separate processes would. Redis's own CPU time is read from
``INFO cpu`` before and after each case.

* latency: one client, one consumer, one job at a time: enqueue -> claim -> publish one
  chunk + Done -> the client has read Done. Median and p99 over ``--jobs`` jobs.
* throughput: ``--clients`` clients each running jobs back to back, ``--consumers``
  consumers with ``--slots`` slots each; every job answers ``--chunks`` chunks + Done.
* chunks, one job: one consumer publishes ``--events`` chunks in batches of ``--batch``
  (one round trip per batch, ``publish_many``), and again one per call; one reader.
* chunks, 100 jobs: the same chunks spread over 100 jobs, each batch mixing all of them,
  100 readers: each with its own blocking read (``RedisJobQueue.events``), or all through
  one ``OutputTail`` (one blocking read for every job, as a router would).

    python benchmarks/redis_queue.py --jobs 3000

Keys live under a fresh prefix and are deleted afterwards (SCAN + UNLINK).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import uvloop

from common import median, pct, print_table, write_json

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
from shoal.jobs.events import Data, Done, OutputEvent, is_final  # noqa: E402
from shoal.protocol.ids import JobId, ModelName, new_job_id  # noqa: E402
from shoal.protocol.messages import Endpoint  # noqa: E402
from shoal.redis_queue.claimed import Claimed  # noqa: E402
from shoal.redis_queue.keys import RedisKeys  # noqa: E402
from shoal.redis_queue.streams import RedisJobQueue  # noqa: E402
from shoal.redis_queue.support import QueuedJob  # noqa: E402
from shoal.redis_queue.tail import OutputTail  # noqa: E402

MODEL = ModelName("bench")
KEY = (MODEL, Endpoint.CHAT)
CHUNK = '{"choices":[{"index":0,"delta":{"content":" token"}}],"object":"chat.completion.chunk"}'
BODY = {"messages": [{"role": "user", "content": "Say something."}], "stream": True}


class Bench:
    def __init__(self, url: str) -> None:
        self.url = url
        self.prefix = f"bench-{uuid.uuid4().hex[:8]}:"
        self.clients: list[aioredis.Redis] = []

    def queue(self, consumer: str) -> RedisJobQueue:
        self.clients.append(aioredis.Redis.from_url(self.url))
        return RedisJobQueue(self.clients[-1], self.prefix, consumer)

    async def redis_cpu(self) -> float:
        info = await self.clients[0].info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    async def close(self) -> None:
        r = self.clients[0]
        async for key in r.scan_iter(match=RedisKeys(self.prefix).pattern, count=1000):
            await r.unlink(key)
        for c in self.clients:
            await c.aclose()


def job() -> QueuedJob:
    return QueuedJob(id=new_job_id(), model=MODEL, endpoint=Endpoint.CHAT, stream=True, body=BODY)


async def read_to_end(q: RedisJobQueue, job_id: JobId) -> int:
    n = 0
    async for d in q.events(job_id):
        n += 1
        if is_final(d.event):
            break
    return n


async def serve(q: RedisJobQueue, slots: int, chunks: int, stop: asyncio.Event) -> int:
    """A consumer: claims up to ``slots`` jobs, answers each with chunks + Done in one batch."""
    served = 0
    while not stop.is_set():
        claims = await q.claim([KEY], slots, 200)
        items: list[tuple[Claimed, OutputEvent]] = []
        for c in claims:
            items += [(c, Data(CHUNK)) for _ in range(chunks)] + [(c, Done())]
        if items:
            await q.publish_many(items)
        served += len(claims)
    return served


async def with_consumers(
    bench: Bench, consumers: int, slots: int, chunks: int, body: Callable[[], Awaitable[Any]]
) -> Any:
    stop = asyncio.Event()
    tasks = [
        asyncio.ensure_future(serve(bench.queue(f"c{i}"), slots, chunks, stop))
        for i in range(consumers)
    ]
    try:
        return await body()
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def latency(bench: Bench, jobs: int) -> dict[str, float]:
    client = bench.queue("client")
    samples: list[float] = []

    async def run() -> None:
        for i in range(jobs + 50):
            j = job()
            t0 = time.perf_counter()
            await client.enqueue(j)
            await read_to_end(client, j.id)
            if i >= 50:  # warm-up: scripts loaded, connections open
                samples.append((time.perf_counter() - t0) * 1000)

    cpu0 = await bench.redis_cpu()
    await with_consumers(bench, 1, 1, 1, run)
    cpu = await bench.redis_cpu() - cpu0
    return {
        "jobs": jobs,
        "p50_ms": median(samples),
        "p99_ms": pct(samples, 99),
        "redis_cpu_us_per_job": cpu / (jobs + 50) * 1e6,
    }


async def throughput(
    bench: Bench, jobs: int, clients: int, consumers: int, slots: int, chunks: int
) -> dict[str, float]:
    qs = [bench.queue(f"client{i}") for i in range(clients)]
    per_client = jobs // clients
    samples: list[float] = []

    async def client(q: RedisJobQueue) -> None:
        for _ in range(per_client):
            j = job()
            t0 = time.perf_counter()
            await q.enqueue(j)
            await read_to_end(q, j.id)
            samples.append((time.perf_counter() - t0) * 1000)

    async def run() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(q) for q in qs))
        return time.perf_counter() - t0

    cpu0 = await bench.redis_cpu()
    elapsed = await with_consumers(bench, consumers, slots, chunks, run)
    cpu = await bench.redis_cpu() - cpu0
    done = per_client * clients
    return {
        "jobs": done,
        "jobs_per_s": done / elapsed,
        "events_per_s": done * (chunks + 2) / elapsed,  # Assigned + chunks + Done
        "p50_ms": median(samples),
        "p99_ms": pct(samples, 99),
        "redis_cpu_share": cpu / elapsed,
    }


async def read_tail(tail: OutputTail, job_id: JobId) -> int:
    n = 0
    async for d in tail.events(job_id):
        n += 1
        if is_final(d.event):
            break
    return n


async def chunks(
    bench: Bench, n_jobs: int, events: int, batch: int, tail: OutputTail | None
) -> dict[str, Any]:
    producer, reader = bench.queue("producer"), bench.queue("reader")
    js = [job() for _ in range(n_jobs)]
    for j in js:
        await reader.enqueue(j)
    claims = await producer.claim([KEY], n_jobs, 200)
    while len(claims) < n_jobs:
        claims += await producer.claim([KEY], n_jobs - len(claims), 200)
    per_job = events // n_jobs
    order = [c for _ in range(per_job) for c in claims]  # round-robin over the jobs
    items: list[tuple[Claimed, OutputEvent]] = [(c, Data(CHUNK)) for c in order]
    items += [(c, Done()) for c in claims]

    cpu0 = await bench.redis_cpu()
    t0 = time.perf_counter()
    readers = [
        asyncio.ensure_future(
            read_to_end(reader, c.job.id) if tail is None else read_tail(tail, c.job.id)
        )
        for c in claims
    ]
    for i in range(0, len(items), batch):
        await producer.publish_many(items[i : i + batch])
    got = sum(await asyncio.gather(*readers))
    elapsed = time.perf_counter() - t0
    cpu = await bench.redis_cpu() - cpu0
    return {
        "jobs": n_jobs,
        "events": per_job * n_jobs,
        "batch": batch,
        "reader": "events" if tail is None else "tail",
        "events_per_s": per_job * n_jobs / elapsed,
        "read_back": got,
        "redis_cpu_share": cpu / elapsed,
    }


# (jobs, events per publish call (0: --batch), read with OutputTail rather than events())
CHUNK_CASES = [(1, 0, False), (1, 1, False), (100, 0, False), (100, 1, False)]
CHUNK_CASES += [(1, 0, True), (100, 0, True), (100, 1, True)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(args.redis_url)
    try:
        results: dict[str, Any] = {"latency": await latency(bench, args.jobs)}
        results["throughput"] = await throughput(
            bench, args.jobs, args.clients, args.consumers, args.slots, args.chunks
        )
        bench.clients.append(aioredis.Redis.from_url(args.redis_url))
        tail = OutputTail(bench.clients[-1], bench.prefix, "bench")
        async with asyncio.TaskGroup() as tg:
            reading = tg.create_task(tail.run())
            for n_jobs, batch, t in CHUNK_CASES:
                results[
                    f"chunks_{n_jobs}job_batch{batch}_{'tail' if t else 'events'}"
                ] = await chunks(
                    bench, n_jobs, args.events, batch if batch else args.batch, tail if t else None
                )
            reading.cancel()
        return results
    finally:
        await bench.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--consumers", type=int, default=4)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        results = runner.run(run(args))

    lat, thr = results["latency"], results["throughput"]
    print_table(
        "Per job, one at a time (enqueue -> claim -> 1 chunk + Done -> client read Done)",
        ["jobs", "p50 ms", "p99 ms", "Redis CPU us/job"],
        [[lat["jobs"], lat["p50_ms"], lat["p99_ms"], lat["redis_cpu_us_per_job"]]],
    )
    print_table(
        f"Concurrent: {args.clients} clients, {args.consumers} consumers x {args.slots} slots, "
        f"{args.chunks} chunks per job",
        ["jobs", "jobs/s", "events/s", "p50 ms", "p99 ms", "Redis CPU share"],
        [
            [
                thr["jobs"],
                thr["jobs_per_s"],
                thr["events_per_s"],
                thr["p50_ms"],
                thr["p99_ms"],
                thr["redis_cpu_share"],
            ]
        ],
    )
    rows = [
        [r["jobs"], r["batch"], r["reader"], r["events"], r["events_per_s"], r["redis_cpu_share"]]
        for name, r in results.items()
        if name.startswith("chunks_")
    ]
    print_table(
        "Output events (publish -> reader)",
        ["jobs", "batch", "reader", "events", "events/s", "Redis CPU share"],
        rows,
    )
    write_json("redis_queue", {"config": vars(args), "results": results})


if __name__ == "__main__":
    main()
