"""``--job-timeout`` on the response side (``relay.JobResponse``), socketless: a job waiting in
the queue gets a 504 and leaves it; a started stream ends with the error event and its worker
is told to stop; a job that ends in time is untouched. (Through real processes:
``tests/e2e/test_job_timeout.py``.)"""

from __future__ import annotations

import asyncio

import orjson
from starlette.types import Message

from shoal.protocol.ids import ModelName
from shoal.protocol.messages import (
    Endpoint,
    JobCancel,
    JobDone,
    ModelInfo,
    decode_router_message,
)
from shoal.router.dispatch.job import Job, JobState, Submission
from shoal.router.dispatch.memory import MemoryDispatcher
from shoal.router.dispatch.workers import WorkerConnection
from shoal.router.routes.relay import JobResponse
from shoal.router.settings import RouterSettings
from socketless import memory_dispatcher, worker_connection

M = ModelName("smol")
LIMIT = 0.2
CHUNK = '{"id":"chatcmpl-1","created":7,"choices":[{"index":0,"delta":{"content":"a"}}]}'


def cluster() -> tuple[MemoryDispatcher, WorkerConnection]:
    dispatcher = memory_dispatcher()
    worker = worker_connection("w", [ModelInfo(name=M, endpoints=(Endpoint.CHAT,))])
    dispatcher.workers.on_registered(worker)
    return dispatcher, worker


async def respond(job: Job, dispatcher: MemoryDispatcher) -> list[Message]:
    """What ``JobResponse`` sends a client that stays connected."""
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError("unreachable")

    response = JobResponse(job, dispatcher, timeout=LIMIT)
    await asyncio.wait_for(response({"type": "http"}, receive, send), 5)
    return sent


def body(sent: list[Message]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def cancels(worker: WorkerConnection) -> list[JobCancel]:
    out = []
    while not worker.outbox.empty():
        msg = decode_router_message(worker.outbox.get_nowait())
        if isinstance(msg, JobCancel):
            out.append(msg)
    return out


async def test_a_job_still_waiting_gets_a_504_and_leaves_the_queue() -> None:
    dispatcher, _ = cluster()
    dispatcher.submit(Submission(M, Endpoint.CHAT, False, {"messages": []}))  # the one slot
    waiting = dispatcher.submit(Submission(M, Endpoint.CHAT, False, {"messages": []}))
    assert waiting.state is JobState.QUEUED
    sent = await respond(waiting, dispatcher)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 504
    error = orjson.loads(body(sent))["error"]
    assert error["code"] == "job_timeout" and error["type"] == "server_error"
    assert "limit of 0.2 s (its --job-timeout)" in error["message"]
    assert waiting.state is JobState.CANCELLED
    assert dispatcher.queue_depths().get(M, 0) == 0


async def test_a_started_stream_ends_with_the_error_event_and_its_worker_stops() -> None:
    dispatcher, worker = cluster()
    job = dispatcher.submit(Submission(M, Endpoint.CHAT, True, {"messages": []}))
    dispatcher.workers.on_chunks(worker, [(job.id, CHUNK, ())])
    sent = await respond(job, dispatcher)
    assert sent[0]["status"] == 200
    assert sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body", False)
    first, last = body(sent).decode().strip().split("\n\n")
    assert first == f"data: {CHUNK}"
    assert orjson.loads(last.removeprefix("data: "))["error"]["code"] == "job_timeout"
    assert "[DONE]" not in body(sent).decode()
    assert job.state is JobState.CANCELLED
    assert [c.job_id for c in cancels(worker)] == [job.id]


async def test_an_answer_that_ends_in_time_is_untouched() -> None:
    dispatcher, worker = cluster()
    job = dispatcher.submit(Submission(M, Endpoint.CHAT, True, {"messages": []}))
    dispatcher.workers.on_chunks(worker, [(job.id, CHUNK, ())])
    dispatcher.workers.on_message(worker, JobDone(job_id=job.id))
    sent = await respond(job, dispatcher)
    assert body(sent).decode().endswith("data: [DONE]\n\n")
    assert job.state is JobState.SUCCEEDED and not cancels(worker)


def test_off_by_default() -> None:
    assert RouterSettings().job_timeout == 0
