"""Runs one job against an OpenAI-compatible HTTP server and reports what happens.

The backend is llama-server (ours, started with ``--alias`` so responses already carry the
public model name) or a server we attach to (vLLM, Ollama, another llama-server), in which
case the request's model is swapped for the backend's and the replies' back again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from shoal.protocol.messages import (
    Endpoint,
    ErrorBody,
    JobDone,
    JobFailed,
    JobResult,
    JobStart,
)
from shoal.worker.aggregate import aggregate
from shoal.worker.pinning import Pin, SlotPinning
from shoal.worker.sink import JobSink

log = logging.getLogger(__name__)

FINISH_BODY_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class BackendTarget:
    """How jobs are sent. ``backend_model`` set means names are swapped on the way."""

    public_model: str
    backend_model: str | None = None
    api_key: str | None = None
    stream_upstream: bool = False
    """Ask the backend for a stream even when the client did not (see ``aggregate``)."""

    @property
    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


def error_from_body(status: int, raw: bytes) -> ErrorBody:
    """The backend's error object, or a readable stand-in when it sent something else."""
    try:
        payload = orjson.loads(raw)
        err = payload.get("error") if isinstance(payload, dict) else None
        if isinstance(err, dict):
            return ErrorBody(
                message=str(err.get("message", "backend error")),
                type=str(err.get("type", "server_error")),
                code=err.get("code") if isinstance(err.get("code"), str | int) else None,
            )
        if isinstance(err, str):
            return ErrorBody(message=err, type="server_error")
    except orjson.JSONDecodeError:
        pass
    text = raw.decode(errors="replace").strip()[:500] or f"HTTP {status}"
    return ErrorBody(message=f"backend answered {status}: {text}", type="server_error")


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
class _Progress:
    started: bool = False
    on_first: Callable[[], None] | None = None
    """Called at the first output (the prompt is computed)."""

    def first(self) -> None:
        if self.on_first is not None:
            self.on_first()
            self.on_first = None


class Backend:
    """One aiohttp session to the backend, shared by every job of this worker."""

    def __init__(
        self,
        target: BackendTarget,
        session: aiohttp.ClientSession,
        base_url: Callable[[], str],
        pinning: SlotPinning | None = None,
    ) -> None:
        """``pinning``: our own llama-server's slots, chosen per job (None for a server we
        attach to, whose slots we do not know)."""
        self.target = target
        self.session = session
        self.base_url = base_url  # llama-server's port may change when it restarts
        self.pinning = pinning

    def _collects(self, job: JobStart) -> bool:
        """Whether this job is streamed from the backend and assembled here."""
        return (
            self.target.stream_upstream
            and not job.stream
            and (job.endpoint is not Endpoint.EMBEDDINGS)
        )

    def _pin(self, job: JobStart) -> contextlib.AbstractAsyncContextManager[Pin | None]:
        return self.pinning.pin(job) if self.pinning else contextlib.nullcontext()

    def _request_body(self, job: JobStart, pin: Pin | None = None) -> bytes:
        body: dict[str, Any] = dict(job.body)
        if pin is not None:
            body["id_slot"] = pin.slot
        if self.target.backend_model is not None:
            body["model"] = self.target.backend_model
        if self._collects(job):
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return orjson.dumps(body)

    def _rename(self, data: str) -> str:
        if self.target.backend_model is None or data == "[DONE]":
            return data
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        if isinstance(obj, dict) and "model" in obj:
            obj["model"] = self.target.public_model
            return orjson.dumps(obj).decode()
        return data

    async def run(self, job: JobStart, out: JobSink) -> None:
        """Run ``job``; every outcome is reported through ``out``. Cancel to stop it."""
        url = self.base_url() + job.endpoint.path
        progress = _Progress()
        try:
            async with (
                self._pin(job) as pin,
                self.session.post(
                    url, data=self._request_body(job, pin), headers=self.target.headers
                ) as resp,
            ):
                if pin is not None and self.pinning is not None:
                    progress.on_first = functools.partial(self.pinning.first_output, pin)
                if resp.status != 200:
                    raw = await resp.read()
                    out.send(
                        JobFailed(
                            job_id=job.job_id,
                            status=resp.status,
                            error=error_from_body(resp.status, raw),
                        )
                    )
                elif self._collects(job):
                    await self._collect(job, resp, out, progress)
                elif not job.stream:
                    out.send(
                        JobResult(
                            job_id=job.job_id, body=self._rename((await resp.read()).decode())
                        )
                    )
                else:
                    await self._stream(job, resp, out, progress)
        except (
            aiohttp.ClientError,
            TimeoutError,
            UnicodeDecodeError,
            orjson.JSONDecodeError,
        ) as exc:
            log.warning("job %s: backend %s failed: %r", job.job_id, url, exc)
            out.send(
                JobFailed(
                    job_id=job.job_id,
                    status=502,
                    started=progress.started,
                    retryable=not progress.started,
                    error=ErrorBody(
                        message=f"The worker's backend failed: {exc!r}",
                        type="server_error",
                        code="backend_error",
                    ),
                )
            )

    async def _stream(
        self, job: JobStart, resp: aiohttp.ClientResponse, out: JobSink, progress: _Progress
    ) -> None:
        job_id = job.job_id
        async for batch in sse_data(resp.content):
            for data in batch:
                if data == "[DONE]":
                    out.send(JobDone(job_id=job_id))
                    await _finish_body(resp)
                    return
                if data.startswith('{"error"'):
                    err = error_from_body(500, data.encode())
                    out.send(
                        JobFailed(job_id=job_id, status=500, error=err, started=progress.started)
                    )
                    return
                if data == "null":  # llama-server's placeholder for a prompt with no output yet
                    continue
                out.chunk(job_id, self._rename(data))
                progress.first()
                progress.started = True
        raise aiohttp.ClientPayloadError("the backend ended the stream without [DONE]")

    async def _collect(
        self, job: JobStart, resp: aiohttp.ClientResponse, out: JobSink, progress: _Progress
    ) -> None:
        chunks: list[dict[str, Any]] = []
        async for batch in sse_data(resp.content):
            for data in batch:
                if data == "[DONE]":
                    body = orjson.dumps(aggregate(chunks, job.endpoint)).decode()
                    out.send(JobResult(job_id=job.job_id, body=self._rename(body)))
                    await _finish_body(resp)
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
                chunks.append(chunk)
        raise aiohttp.ClientPayloadError("the backend ended the stream without [DONE]")


async def _finish_body(resp: aiohttp.ClientResponse) -> None:
    """Read the end of the HTTP body after [DONE], so the connection is kept for reuse."""
    async with asyncio.timeout(FINISH_BODY_TIMEOUT_S):
        await resp.read()


async def discover_model(
    session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]
) -> str:
    """The first model an attached backend lists at /v1/models."""
    async with session.get(base_url + "/v1/models", headers=headers) as resp:
        resp.raise_for_status()
        payload = await resp.json(loads=orjson.loads)
    data = payload.get("data") or payload.get("models") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --backend-model")
    first = data[0]
    return str(first.get("id") or first.get("name"))
