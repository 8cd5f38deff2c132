"""Runs one job against an OpenAI-compatible HTTP server and reports what happens.

The backend is llama-server (ours, started with ``--alias`` so responses already carry the
public model name) or a server we attach to (vLLM, Ollama, another llama-server), in which
case the request's model is swapped for the backend's and the replies' back again.

How an answer is read and passed on is ``streams.py``; a job going on with another worker's
answer runs through ``resume/going_on.py``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from shoal.protocol.messages import Endpoint, ErrorBody, JobDone, JobFailed, JobResult, JobStart
from shoal.worker.jobs.sink import JobSink
from shoal.worker.text import loopback, typed_streams
from shoal.worker.text.backend_errors import context_needed, error_from_body
from shoal.worker.text.pinning import Pin, SlotPinning
from shoal.worker.text.resume.continuation import (
    TokenTrail,
    WholeAnswer,
    client_wants_logprobs,
    with_token_ids,
)
from shoal.worker.text.resume.going_on import GoingOn
from shoal.worker.text.streams import Progress, collect, ended, finish_body, relay, sse_data
from shoal.worker.text.typed_streams import StreamEnd, backend_body

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendTarget:
    """How jobs are sent. ``backend_model`` set means names are swapped on the way."""

    public_model: str
    backend_model: str | None = None
    api_key: str | None = None
    stream_upstream: bool = False
    """Ask the backend for a stream even when the client did not (see ``aggregate``)."""
    token_ids: bool = False
    """The backend is llama-server: streams report their token ids and lost answers can be
    resumed here (``continuation``)."""
    ask_usage: bool = False
    """Streams always ask for their usage (``stream_options.include_usage``): an attached
    server counts their tokens nowhere else (llama-server's ``timings`` do); the router
    charges it and keeps it from a client that did not ask (``router/admission/usage.py``)."""
    spare_path: str | None = None
    """A cheap GET the backend answers: each job's connection is closed as it ends and one
    is opened for the next job with it (``loopback.open_spare``). None: connections are
    pooled as they come."""

    @property
    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    @property
    def job_headers(self) -> dict[str, str]:
        """A job's: with a spare, its connection is closed with its answer, never pooled
        (llama-server closes it after a stream, which the pool may not notice in time)."""
        if self.spare_path is None:
            return self.headers
        return {**self.headers, "Connection": "close"}


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
            and job.endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS)
        )

    def _trails(self, job: JobStart) -> bool:
        """Whether this job's stream reports its token ids (``TokenTrail``)."""
        return (
            self.target.token_ids
            and job.stream
            and job.endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS)
        )

    def _pin(self, job: JobStart) -> contextlib.AbstractAsyncContextManager[Pin | None]:
        return self.pinning.pin(job) if self.pinning else contextlib.nullcontext()

    def _tracks(self, job: JobStart) -> bool:
        """Whether this non-streamed job reports its token ids as progress (chunks the router
        keeps and never sends on), to go on elsewhere and be answered whole (with the
        log-probabilities of those ids when the client asked for them)."""
        return (
            self.target.token_ids
            and self._collects(job)
            and job.endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS)
        )

    def _request_body(self, job: JobStart, pin: Pin | None = None) -> bytes:
        body: dict[str, Any] = dict(backend_body(job.endpoint, job.body))
        if pin is not None:
            body["id_slot"] = pin.slot
        if self.target.backend_model is not None:
            body["model"] = self.target.backend_model
        if self._collects(job):
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        elif self.target.ask_usage and job.stream and job.endpoint.streams_usage:
            options = body.get("stream_options")
            asked = options if isinstance(options, dict) else {}
            body["stream_options"] = {**asked, "include_usage": True}
        if self._trails(job) or self._tracks(job):
            body = with_token_ids(body, job.endpoint)
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

    async def _post(self, url: str, body: bytes) -> aiohttp.ClientResponse:
        return await loopback.post(self.session, url, body, self.target.job_headers)

    async def run(self, job: JobStart, out: JobSink) -> None:
        """Run ``job``; every outcome is reported through ``out``. Cancel to stop it."""
        url = self.base_url() + job.endpoint.path
        progress = Progress(started=job.resume is not None)
        try:
            async with self._pin(job) as pin:
                if job.resume is not None:
                    going_on = GoingOn(
                        self.base_url, self._post, self._rename, self.target.token_ids
                    )
                    await going_on.run(job, job.resume, out, pin)
                    return
                if pin is not None and self.pinning is not None:
                    progress.on_first = functools.partial(self.pinning.first_output, pin)
                async with await self._post(url, self._request_body(job, pin)) as resp:
                    await self._answer(job, resp, out, progress)
            if self.target.spare_path is not None:  # for the next job, the slot free
                spare = self.base_url() + self.target.spare_path
                await loopback.open_spare(self.session, spare, self.target.headers)
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
                    resumable=progress.started and self.target.token_ids,
                    error=ErrorBody(
                        message=f"The worker's backend failed: {exc!r}",
                        type="server_error",
                        code="backend_error",
                    ),
                )
            )

    async def _answer(
        self, job: JobStart, resp: aiohttp.ClientResponse, out: JobSink, progress: Progress
    ) -> None:
        """Pass the backend's answer to ``job`` on: an error, whole, assembled, or streamed."""
        if resp.status != 200:
            raw = await resp.read()
            out.send(
                JobFailed(
                    job_id=job.job_id,
                    status=resp.status,
                    error=error_from_body(resp.status, raw),
                    context_needed=context_needed(resp.status, raw),
                )
            )
        elif self._collects(job):
            chat = job.endpoint is Endpoint.CHAT
            strip = not client_wants_logprobs(job.body, job.endpoint)
            trail = TokenTrail(strip=strip, chat=chat) if self._tracks(job) else None
            await collect(job, resp, out, WholeAnswer(trail), progress, self._rename)
        elif not job.stream:
            body = self._rename((await resp.read()).decode())
            out.send(JobResult(job_id=job.job_id, body=body))
        else:
            await self._stream(job, resp, out, progress)

    async def _stream(
        self, job: JobStart, resp: aiohttp.ClientResponse, out: JobSink, progress: Progress
    ) -> None:
        job_id = job.job_id
        if job.endpoint.typed_events:
            await self._typed(job, resp, out, progress)
            return
        if self._trails(job):
            strip = not client_wants_logprobs(job.body, job.endpoint)
            trail = TokenTrail(strip=strip, chat=job.endpoint is Endpoint.CHAT)
            await relay(job, resp, out, trail, None, progress, self._rename)
            return
        async for batch in sse_data(resp.content):
            for data in batch:
                if await ended(data, job_id, resp, out, started=progress.started):
                    return
                if data == "null":  # llama-server's placeholder for a prompt with no output yet
                    continue
                out.chunk(job_id, self._rename(data))
                progress.first()
                progress.started = True
        raise aiohttp.ClientPayloadError("the backend ended the stream without [DONE]")

    async def _typed(
        self, job: JobStart, resp: aiohttp.ClientResponse, out: JobSink, progress: Progress
    ) -> None:
        """A Responses or Messages stream: its events pass on as they are, up to its last
        event (``typed_streams``; there is no ``[DONE]``)."""
        async for batch in sse_data(resp.content):
            for data in batch:
                end = typed_streams.stream_end(data)
                if end is StreamEnd.ERROR:
                    err = error_from_body(500, typed_streams.error_payload(data))
                    out.send(JobFailed(job_id=job.job_id, status=500, error=err, started=True))
                    return
                out.chunk(job.job_id, data)
                progress.first()
                progress.started = True
                if end is StreamEnd.DONE:
                    out.send(JobDone(job_id=job.job_id))
                    await finish_body(resp)
                    return
        raise aiohttp.ClientPayloadError("the backend ended the stream before its last event")


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
