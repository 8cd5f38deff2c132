"""How long the router takes to place a request among N workers (in this process).

A registry of N real ``WorkerConnection`` objects, built from the stand-ins' registrations
(``standins.register``) and one worker serving the requested model, behind a real
``MemoryDispatcher``; each sample is one ``submit`` of a chat request that finds the free
slot (the answers' checks, the context need, ``pick_worker`` over every worker, the
``JobStart`` queued for the worker), then its cancel, which frees the slot again.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from shoal.protocol.ids import ModelName, WorkerId
from shoal.protocol.messages import Endpoint, ModelInfo
from shoal.router.dispatch.job import Submission
from shoal.router.dispatch.memory import MemoryDispatcher
from shoal.router.dispatch.workers import ConnState, Registry, WorkerConnection
from shoal.router.observe.metrics import Metrics, Snapshot
from shoal.router.settings import RouterSettings
from standins import register

MODEL = ModelName("placed")
SAMPLES = 200


def _connection(index: int, model: ModelName | None = None) -> WorkerConnection:
    msg = register(index)
    if model is not None:
        info = ModelInfo(name=model, endpoints=(Endpoint.CHAT,), context_length=4096)
        msg = msg.model_copy(update={"models": (info,), "worker_id": WorkerId(f"real-{index}")})
    conn = WorkerConnection.from_register(msg, "127.0.0.1:1")
    conn.move(ConnState.ACTIVE, "placement timing")
    return conn


async def _time(count: int) -> list[float]:
    registry = Registry()
    dispatcher = MemoryDispatcher(RouterSettings(), registry, Metrics(lambda: Snapshot()))
    for i in range(count):
        dispatcher.workers.on_registered(_connection(i))
    dispatcher.workers.on_registered(_connection(count, MODEL))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    ask = Submission(model=MODEL, endpoint=Endpoint.CHAT, stream=False, body=body)
    took = []
    for _ in range(SAMPLES):
        started = time.perf_counter()
        job = dispatcher.submit(ask)
        took.append((time.perf_counter() - started) * 1000)
        assert job.worker_id == WorkerId(f"real-{count}"), job.worker_id
        dispatcher.cancel(job, "timed")
    return took


def placement_p50_ms(count: int) -> float:
    """The median time to place a request among ``count`` workers and one that serves it."""
    return statistics.median(asyncio.run(_time(count)))
