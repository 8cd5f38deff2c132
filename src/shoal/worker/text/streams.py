"""Reading a backend's answer: its ``data:`` payloads, how a stream ends, and llama-server's
chunks passed on with the token ids they complete (``relay``) or assembled into one answer
(``collect``).

Shared by a job's own run (``backend.py``) and a job going on with another worker's answer
(``resume/going_on.py``). ``rename`` swaps an attached backend's model name back for the
public one (the identity for our own llama-server).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
import orjson

from shoal.protocol.ids import JobId
from shoal.protocol.messages import JobDone, JobFailed, JobResult, JobStart
from shoal.worker.jobs.sink import JobSink
from shoal.worker.text.backend_errors import error_from_body
from shoal.worker.text.resume.continuation import Splice, TokenTrail, WholeAnswer

log = logging.getLogger(__name__)

FINISH_BODY_TIMEOUT_S = 5.0

Rename = Callable[[str], str]


async def sse_data(content: aiohttp.StreamReader) -> AsyncIterator[list[str]]:
    """Yield the ``data:`` payloads that arrived together, as lists (one list per read)."""
    buf = b""
    async for piece in content.iter_any():
        buf += piece
        if b"\n" not in piece:
            continue
        *lines, buf = buf.split(b"\n")
        out = [line[5:].strip().decode() for line in lines if line.startswith(b"data:")]
        if out:
            yield out
    if buf.startswith(b"data:"):
        yield [buf[5:].strip().decode()]


@dataclass
class Progress:
    started: bool = False
    """Output (or, for a non-streamed job, its token ids) was sent on."""
    on_first: Callable[[], None] | None = None
    """Called at the first output (the prompt is computed)."""

    def first(self) -> None:
        if self.on_first is not None:
            self.on_first()
            self.on_first = None


async def relay(
    job: JobStart,
    resp: aiohttp.ClientResponse,
    out: JobSink,
    trail: TokenTrail,
    splice: Splice | None,
    progress: Progress,
    rename: Rename,
) -> None:
    """Stream llama-server's chunks on with the token ids they complete (through
    ``splice`` when going on with another worker's answer)."""
    job_id = job.job_id
    carry: list[int] = []
    async for batch in sse_data(resp.content):
        for data in batch:
            if await ended(data, job_id, resp, out, started=True):
                return
            if data == "null":
                continue
            chunk = orjson.loads(data)
            released = trail.follow(chunk)
            if released is not None:
                carry += released
            for part in [chunk] if splice is None else list(splice.chunks(chunk)):
                ids = None if released is None else tuple(carry)
                if ids is not None:
                    carry.clear()
                out.chunk(job_id, rename(orjson.dumps(part).decode()), ids)
                progress.first()
                progress.started = True
    raise aiohttp.ClientPayloadError("the backend ended the stream without [DONE]")


async def collect(
    job: JobStart,
    resp: aiohttp.ClientResponse,
    out: JobSink,
    collected: WholeAnswer,
    progress: Progress,
    rename: Rename,
) -> None:
    """Assemble a non-streamed answer from the backend's stream, reporting its token ids
    as they come when ``collected`` follows them."""
    async for batch in sse_data(resp.content):
        for data in batch:
            if data == "[DONE]":
                body = orjson.dumps(collected.answer(job.endpoint)).decode()
                out.send(JobResult(job_id=job.job_id, body=rename(body)))
                await finish_body(resp)
                return
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                log.warning("job %s: backend sent a non-JSON chunk: %.200s", job.job_id, data)
                continue
            if not isinstance(chunk, dict):  # llama-server streams `null` for some prompts
                continue
            if "error" in chunk:
                err = error_from_body(500, data.encode())
                out.send(JobFailed(job_id=job.job_id, status=500, error=err))
                return
            progress.first()
            head = collected.take(chunk)
            if head is not None:
                out.chunk(job.job_id, head, collected.ids)
                progress.started = True
    raise aiohttp.ClientPayloadError("the backend ended the stream without [DONE]")


async def ended(
    data: str, job_id: JobId, resp: aiohttp.ClientResponse, out: JobSink, *, started: bool
) -> bool:
    """Whether ``data`` ends a streamed answer: ``[DONE]``, or llama-server's error event
    (reported as the job's failure; ``started``: output had gone out)."""
    if data == "[DONE]":
        out.send(JobDone(job_id=job_id))
        await finish_body(resp)
        return True
    if data.startswith('{"error"'):
        err = error_from_body(500, data.encode())
        out.send(JobFailed(job_id=job_id, status=500, error=err, started=started))
        return True
    return False


async def finish_body(resp: aiohttp.ClientResponse) -> None:
    """Read the end of the HTTP body after [DONE], so the connection is kept for reuse."""
    async with asyncio.timeout(FINISH_BODY_TIMEOUT_S):
        await resp.read()
