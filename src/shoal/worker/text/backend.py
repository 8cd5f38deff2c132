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

from shoal.protocol.ids import JobId
from shoal.protocol.messages import (
    Continuation,
    Endpoint,
    ErrorBody,
    JobDone,
    JobFailed,
    JobResult,
    JobStart,
)
from shoal.worker.jobs.sink import JobSink
from shoal.worker.text import loopback, typed_streams
from shoal.worker.text.backend_errors import context_needed, error_from_body
from shoal.worker.text.pinning import Pin, SlotPinning
from shoal.worker.text.resume.continuation import (
    NotResumable,
    Splice,
    TokenTrail,
    WholeAnswer,
    client_wants_logprobs,
    continuation,
    prefill_prompts,
    remaining_tokens,
    template_request,
    with_token_ids,
)
from shoal.worker.text.typed_streams import StreamEnd, backend_body

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
    """Output (or, for a non-streamed job, its token ids) was sent on."""
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
        progress = _Progress(started=job.resume is not None)
        try:
            async with self._pin(job) as pin:
                if job.resume is not None:
                    await self._go_on(job, job.resume, out, pin)
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
        self, job: JobStart, resp: aiohttp.ClientResponse, out: JobSink, progress: _Progress
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
            await self._collect(job, resp, out, WholeAnswer(trail), progress)
        elif not job.stream:
            body = self._rename((await resp.read()).decode())
            out.send(JobResult(job_id=job.job_id, body=body))
        else:
            await self._stream(job, resp, out, progress)

    async def _stream(
        self, job: JobStart, resp: aiohttp.ClientResponse, out: JobSink, progress: _Progress
    ) -> None:
        job_id = job.job_id
        if job.endpoint.typed_events:
            await self._typed(job, resp, out, progress)
            return
        if self._trails(job):
            strip = not client_wants_logprobs(job.body, job.endpoint)
            trail = TokenTrail(strip=strip, chat=job.endpoint is Endpoint.CHAT)
            await self._relay(job, resp, out, trail, None, progress)
            return
        async for batch in sse_data(resp.content):
            for data in batch:
                if await _ended(data, job_id, resp, out, started=progress.started):
                    return
                if data == "null":  # llama-server's placeholder for a prompt with no output yet
                    continue
                out.chunk(job_id, self._rename(data))
                progress.first()
                progress.started = True
        raise aiohttp.ClientPayloadError("the backend ended the stream without [DONE]")

    async def _typed(
        self, job: JobStart, resp: aiohttp.ClientResponse, out: JobSink, progress: _Progress
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
                    await _finish_body(resp)
                    return
        raise aiohttp.ClientPayloadError("the backend ended the stream before its last event")

    async def _go_on(
        self, job: JobStart, resume: Continuation, out: JobSink, pin: Pin | None
    ) -> None:
        """Go on with an answer another worker began (``continuation``), in ``pin``'s slot."""
        if not self.target.token_ids:
            out.send(_not_resumable(job, "this worker's backend is not its own llama-server"))
            return
        chat = job.endpoint is Endpoint.CHAT
        options = job.body.get("stream_options")
        splice = Splice(
            job.endpoint,
            resume,
            include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
        )
        left = remaining_tokens(job.body, len(resume.tokens))
        if left is not None and left <= 0 and job.stream:  # lost between its end and [DONE]
            for chunk in splice.chunks(_length_end(chat)):
                out.chunk(job.job_id, orjson.dumps(chunk).decode(), ())
            out.send(JobDone(job_id=job.job_id))
            return
        try:
            prompt = await self._chat_prompt(job.body) if chat else None
            body = continuation(job.body, job.endpoint, resume, prompt)
            before = "" if job.stream else await self._text_of(resume.tokens)
            if pin is not None:
                body["id_slot"] = pin.slot
            await self._prefill(body, len(resume.tokens), pin)
        except NotResumable as exc:
            out.send(_not_resumable(job, str(exc)))
            return
        if not job.stream:
            splice.include_usage = True  # the whole answer has its usage
            if left is not None and left <= 0:  # lost between its last token and its end
                collected = WholeAnswer(None, splice, before, before_logprobs=resume.logprobs)
                collected.take(_length_end(chat))
                body_out = orjson.dumps(collected.answer(job.endpoint)).decode()
                out.send(JobResult(job_id=job.job_id, body=self._rename(body_out)))
                return
        log.info(
            "job %s model=%s: going on after %d tokens", job.job_id, job.model, len(resume.tokens)
        )
        url = self.base_url() + Endpoint.COMPLETIONS.path
        async with await self._post(url, orjson.dumps(body)) as resp:
            if resp.status != 200:
                raw = await resp.read()
                error = error_from_body(resp.status, raw)
                out.send(_not_resumable(job, error.message))
                return
            strip = not client_wants_logprobs(job.body, job.endpoint)
            trail = TokenTrail(strip=strip, chat=False)
            if not job.stream:
                collected = WholeAnswer(trail, splice, before, before_logprobs=resume.logprobs)
                await self._collect(job, resp, out, collected, _Progress(started=True))
                return
            await self._relay(job, resp, out, trail, splice, _Progress(started=True))

    async def _prefill(self, body: dict[str, Any], produced: int, pin: Pin | None) -> None:
        """Put the continuation's prompt into the slot's cache the way the original run
        computed it (``prefill_prompts``: the prompt, then the produced ids a few at a time),
        so that the continuation is exactly the uninterrupted answer."""
        url = self.base_url() + "/completion"
        for prompt in prefill_prompts(body["prompt"], produced):
            step: dict[str, Any] = {"prompt": prompt, "n_predict": 0, "cache_prompt": True}
            if pin is not None:
                step["id_slot"] = pin.slot
            async with await self._post(url, orjson.dumps(step)) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise NotResumable(error_from_body(resp.status, raw).message)

    async def _text_of(self, tokens: tuple[int, ...]) -> str:
        """The text of ``tokens`` as llama-server spells them: what a non-streamed answer had
        produced before its worker was lost (exactly: ids are sent only where the text so
        far is exactly theirs)."""
        return await self._ask_text("/detokenize", {"tokens": list(tokens)}, "content")

    async def _chat_prompt(self, body: dict[str, Any]) -> str:
        return await self._ask_text("/apply-template", template_request(body), "prompt")

    async def _ask_text(self, path: str, payload: dict[str, Any], field: str) -> str:
        """The text ``field`` of llama-server's answer to ``payload`` at ``path``; raises
        ``NotResumable`` when it refuses or answers without it."""
        async with await self._post(self.base_url() + path, orjson.dumps(payload)) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise NotResumable(error_from_body(resp.status, raw).message)
        text = orjson.loads(raw).get(field)
        if not isinstance(text, str):
            raise NotResumable(f"{path} gave no {field}")
        return text

    async def _relay(
        self,
        job: JobStart,
        resp: aiohttp.ClientResponse,
        out: JobSink,
        trail: TokenTrail,
        splice: Splice | None,
        progress: _Progress,
    ) -> None:
        """Stream llama-server's chunks on with the token ids they complete (through
        ``splice`` when going on with another worker's answer)."""
        job_id = job.job_id
        carry: list[int] = []
        async for batch in sse_data(resp.content):
            for data in batch:
                if await _ended(data, job_id, resp, out, started=True):
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
                    out.chunk(job_id, self._rename(orjson.dumps(part).decode()), ids)
                    progress.first()
                    progress.started = True
        raise aiohttp.ClientPayloadError("the backend ended the stream without [DONE]")

    async def _collect(
        self,
        job: JobStart,
        resp: aiohttp.ClientResponse,
        out: JobSink,
        collected: WholeAnswer,
        progress: _Progress,
    ) -> None:
        """Assemble a non-streamed answer from the backend's stream, reporting its token ids
        as they come when ``collected`` follows them."""
        async for batch in sse_data(resp.content):
            for data in batch:
                if data == "[DONE]":
                    body = orjson.dumps(collected.answer(job.endpoint)).decode()
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
                head = collected.take(chunk)
                if head is not None:
                    out.chunk(job.job_id, head, collected.ids)
                    progress.started = True
        raise aiohttp.ClientPayloadError("the backend ended the stream without [DONE]")


async def _ended(
    data: str, job_id: JobId, resp: aiohttp.ClientResponse, out: JobSink, *, started: bool
) -> bool:
    """Whether ``data`` ends a streamed answer: ``[DONE]``, or llama-server's error event
    (reported as the job's failure; ``started``: output had gone out)."""
    if data == "[DONE]":
        out.send(JobDone(job_id=job_id))
        await _finish_body(resp)
        return True
    if data.startswith('{"error"'):
        err = error_from_body(500, data.encode())
        out.send(JobFailed(job_id=job_id, status=500, error=err, started=started))
        return True
    return False


def _length_end(chat: bool) -> dict[str, Any]:
    """The last chunk of an answer that reached its token limit (as llama-server ends it)."""
    if chat:
        return {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}]}
    return {"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}]}


def _not_resumable(job: JobStart, why: str) -> JobFailed:
    log.warning("job %s model=%s: cannot go on with its answer: %s", job.job_id, job.model, why)
    return JobFailed(
        job_id=job.job_id,
        status=502,
        started=True,
        error=ErrorBody(
            message=f"The worker serving this request was lost and its answer could not be "
            f"resumed ({why}); the answer is incomplete. Retry the request.",
            type="server_error",
            code="worker_lost",
        ),
    )


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
