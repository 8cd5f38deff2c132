"""The response side of a job: waits for a worker, then streams or returns its answer.

``JobResponse`` is an ASGI response that watches the client the whole time: if the client
disconnects while the job waits or streams, the job is cancelled and the worker stops it. Past
``--job-timeout`` from its submission the job is cancelled too, and the client gets a 504
``job_timeout`` error (as the stream's error event, when the stream has started).

A streamed job whose worker loads its model first (``Loading``) starts its stream then, and
shows ``: loading model=<name>`` (an SSE comment, which clients ignore) before its first
token; whatever ends it after that (a failure, ``--max-wait``, ``--job-timeout``) is its
stream's error event. A non-streamed job just waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from shoal.jobs.events import (
    ClientEvent,
    Data,
    Done,
    Failed,
    Loading,
    Requeued,
    Result,
    worker_lost,
)
from shoal.router.admission.accounting import Accounting, Ticket
from shoal.router.admission.result_cache.interface import CacheFill
from shoal.router.admission.usage import asks_usage, for_client
from shoal.router.dispatch.interface import Dispatcher
from shoal.router.dispatch.job import Job
from shoal.router.errors import (
    REQUEST_ID,
    WORKER_ID,
    JobTimedOut,
    RouterError,
    UpstreamError,
    error_reply,
)
from shoal.router.routes.dialects import Dialect

log = logging.getLogger(__name__)

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_JSON_HEADERS = [(b"content-type", b"application/json")]


class ClientGone(Exception):
    pass


class JobResponse(Response):
    def __init__(
        self,
        job: Job,
        dispatcher: Dispatcher,
        accounting: Accounting | None = None,
        ticket: Ticket | None = None,
        fill: CacheFill | None = None,
        *,
        timeout: float = 0.0,
        dialect: Dialect | None = None,
        keep: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__()
        self.job = job
        self.dialect = dialect or Dialect()
        """How the job's API frames its events and errors and counts its tokens."""
        self.keep = keep
        """Stores the answer once it completed (a response asked for with ``store: true``),
        before the client has its last bytes."""
        self.dispatcher = dispatcher
        self.accounting = accounting
        self.ticket = ticket
        self.fill = fill
        """Collects a cacheable answer for the result cache."""
        self.timeout = timeout
        """``--job-timeout``: seconds from the job's submission to its end (0: no limit)."""
        self.status_code = 0
        self.answer: str | None = None
        """The result body, or the last streamed payload (where usage and timings are)."""
        self.strip_usage = job.stream and job.endpoint.streams_usage and not asks_usage(job.body)
        """The client did not ask for usage: its stream gets none (``usage.for_client``),
        though its tokens are charged from it."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                watcher = tg.create_task(_watch_disconnect(receive))
                try:
                    await self._respond_in_time(scope, send)
                finally:
                    watcher.cancel()
        except* ClientGone:
            log.info("job %s model=%s: client disconnected", self.job.id, self.job.model)
        except* OSError:
            log.info("job %s model=%s: client connection broke", self.job.id, self.job.model)
        finally:
            self.dispatcher.cancel(self.job, "client disconnected")
            tokens = self.dialect.tokens(self.answer) if self.answer else None
            if tokens is not None:  # its key's share is corrected by what it really cost
                self.dispatcher.settle(self.job, sum(tokens))
            if self.accounting is not None and self.ticket is not None:
                cached = self.dialect.cached(self.answer) if self.answer else None
                await self.accounting.finish(self.ticket, self.job, tokens, cached)

    async def _respond_in_time(self, scope: Scope, send: Send) -> None:
        """``_respond``, ended by ``--job-timeout`` with its error where the response is."""
        if not self.timeout:
            await self._respond(scope, send)
            return
        sent = _Sent(send)
        limit = asyncio.timeout(max(0.0, self.job.created + self.timeout - time.monotonic()))
        try:
            async with limit:
                await self._respond(scope, sent)
        except TimeoutError:
            if not limit.expired():
                raise
            await self._timed_out(scope, sent)

    async def _timed_out(self, scope: Scope, sent: _Sent) -> None:
        job = self.job
        log.warning(
            "job %s model=%s worker=%s: stopped after %g s (--job-timeout)",
            job.id,
            job.model,
            job.worker_id,
            self.timeout,
        )
        self.dispatcher.cancel(job, f"over --job-timeout ({self.timeout:g} s)")
        error = JobTimedOut(self.timeout)
        if not sent.started:
            await self._refuse(scope, sent, error)
        elif not sent.complete:  # a stream gets the error event; a body cut short, its end
            body = self.dialect.error_event(error) if sent.sse else b""
            await sent({"type": "http.response.body", "body": body})

    async def _respond(self, scope: Scope, send: Send) -> None:
        job = self.job
        positions = self.dispatcher.queue_positions(job) if job.stream else None
        if positions is not None:
            # Its first place is known before the headers leave, so a refusal that comes
            # only then (a key over its cap, with a shared Redis queue) is still a 429.
            try:
                place = await anext(positions, None)
            except RouterError as exc:
                await self._refuse(scope, send, exc)
                return
            if place is not None:
                await self._stream_after_queue(send, place, positions)
                return
        try:
            await self.dispatcher.wait_assigned(job)
            first = await self._next_answer(loading=job.stream)
        except RouterError as exc:
            await self._refuse(scope, send, exc)
            return
        if isinstance(first, Loading):
            await self._start(send, 200, _SSE_HEADERS)
            await self._stream_started(send, first)
            return
        if isinstance(first, Result):
            self.answer = first.body
            await self._kept(first.body)
            await self._start(send, 200, _JSON_HEADERS)
            await send({"type": "http.response.body", "body": first.body.encode()})
            if self.fill is not None:
                await self.fill.finish_body(first.body)
        elif isinstance(first, Failed):
            await self._refuse(scope, send, UpstreamError(first.status, first.error))
        elif isinstance(first, Data):
            await self._stream(send, first)

    async def _refuse(self, scope: Scope, send: Send, exc: RouterError) -> None:
        """An error instead of an answer, with the job's id (and its worker's, if it had one)."""
        response = error_reply(exc, self.job.id, self.job.worker_id, self.dialect.error_response)
        self.status_code = response.status_code
        await response(scope, _no_receive, send)

    async def _next_answer(self, loading: bool = False) -> ClientEvent:
        """The first event that answers the client, waiting again if the job is re-queued;
        ``loading``: or that its model loads (else that is passed over)."""
        while True:
            event = await self.job.events.get()
            if isinstance(event, Requeued):
                await self.dispatcher.wait_assigned(self.job)
            elif not isinstance(event, Loading) or loading:
                return event

    async def _start(self, send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        headers = [*headers, (REQUEST_ID.encode(), self.job.id.encode())]
        if self.job.worker_id:
            headers.append((WORKER_ID.encode(), self.job.worker_id.encode()))
        if self.ticket is not None:
            headers += [(k.encode(), v.encode()) for k, v in self.ticket.headers.items()]
        if self.fill is not None:
            headers.append((b"x-shoal-cache", b"miss"))
        self.status_code = status
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _stream_after_queue(
        self, send: Send, first_place: int, positions: AsyncIterator[int]
    ) -> None:
        """A stream that has to wait starts at once and says where it stands in the queue
        (SSE comments, which clients ignore); its worker, unknown when the headers left,
        follows in a comment too. Refused after all (past ``--max-wait``): an error event."""
        await self._start(send, 200, _SSE_HEADERS)
        await _send_more(send, f": queued position={first_place}\n\n".encode())
        await self._stream_started(send, None, positions)

    async def _stream_started(
        self, send: Send, loading: Loading | None, positions: AsyncIterator[int] | None = None
    ) -> None:
        """A stream whose headers left before its first token: its places in the queue, the
        worker (when unknown as the headers left), ``: loading`` while its model loads, then
        its events. Refused after all (past ``--max-wait``): an error event."""
        named = positions is None  # its headers named the worker
        try:
            if positions is not None:
                async for place in positions:
                    await _send_more(send, f": queued position={place}\n\n".encode())
            first = loading or await self._next_answer(loading=True)
            while isinstance(first, Loading):
                if self.job.worker_id and not named:
                    await _send_more(send, f": worker={self.job.worker_id}\n\n".encode())
                    named = True
                await _send_more(send, _loading_comment(first))
                first = await self._next_answer(loading=True)
        except RouterError as exc:
            await send({"type": "http.response.body", "body": self.dialect.error_event(exc)})
            return
        if self.job.worker_id and not named:
            await _send_more(send, f": worker={self.job.worker_id}\n\n".encode())
        if isinstance(first, Data):
            await self._stream_events(send, first)
            return
        buf, _ = self._encode([first])  # it ended without output: its error, or [DONE]
        await send({"type": "http.response.body", "body": bytes(buf)})

    async def _stream(self, send: Send, first: Data) -> None:
        await self._start(send, 200, _SSE_HEADERS)
        await self._stream_events(send, first)

    async def _stream_events(self, send: Send, first: Data) -> None:
        events = self.job.events
        pending: list[ClientEvent] = [first]
        while True:
            buf, end = self._encode(pending)
            if end is not None:
                if isinstance(end, Done) and self.answer is not None:
                    await self._kept(self.answer)
                await send({"type": "http.response.body", "body": bytes(buf)})
                if isinstance(end, Done) and self.fill is not None:
                    await self.fill.finish_stream()
                return
            if buf:
                await send({"type": "http.response.body", "body": bytes(buf), "more_body": True})
            if self.accounting is not None and self.ticket is not None and self.ticket.slot:
                await self.accounting.keepalive(self.ticket)
            if any(isinstance(event, Requeued) for event in pending) and not (
                await self._going_on()
            ):
                failed = worker_lost("no worker could go on with the answer within --max-wait")
                await send({"type": "http.response.body", "body": bytes(self._encode([failed])[0])})
                return
            pending = [await events.get()]
            while not events.empty():
                pending.append(events.get_nowait())

    async def _kept(self, answer: str) -> None:
        """``keep`` the completed answer; one the store cannot take is answered all the same."""
        if self.keep is None:
            return
        try:
            await self.keep(answer)
        except RouterError as exc:
            log.warning("job %s model=%s: answer not stored: %s", self.job.id, self.job.model, exc)

    async def _going_on(self) -> bool:
        """The answer's worker was lost mid-answer and it waits to go on elsewhere: until a
        worker takes it; False past ``--max-wait`` (it was withdrawn)."""
        try:
            await self.dispatcher.wait_assigned(self.job)
        except RouterError as exc:
            log.warning(
                "job %s model=%s: nobody went on with it: %s", self.job.id, self.job.model, exc
            )
            return False
        return True

    def _encode(self, pending: list[ClientEvent]) -> tuple[bytearray, Done | Failed | None]:
        """SSE bytes for a batch of events, and the event that ends the stream, if any."""
        buf = bytearray()
        for event in pending:
            if isinstance(event, Data):
                self.answer = event.data
                data = for_client(event.data) if self.strip_usage else event.data
                if data is None:
                    continue
                if self.fill is not None:
                    self.fill.data(data)
                buf += self.dialect.event(data)
            elif isinstance(event, Loading):  # going on on a worker that loads it first
                buf += _loading_comment(event)
            elif isinstance(event, Done):
                buf += self.dialect.done
                return buf, event
            elif isinstance(event, Failed):
                buf += self.dialect.error_event(UpstreamError(500, event.error))
                return buf, event
        return buf, None


class _Sent:
    """``send``, remembering how far the response got (what a timeout may still send)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.sse = False
        self.complete = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.sse = _SSE_HEADERS[0] in message.get("headers", ())
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)


def _loading_comment(event: Loading) -> bytes:
    return f": loading model={event.model}\n\n".encode()


async def _send_more(send: Send, body: bytes) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": True})


async def _watch_disconnect(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
