"""The worker's one connection to its router, with its state machine and reconnects.

WAITING (at start) ──▶ CONNECTING ──handshake ok──▶ REGISTERED ──socket lost──▶ WAITING
                           │                                                       ▲
                           └──connect failed───────────────────────────────────────┘
refused for a bad key or protocol version ──▶ raises ``RouterRefused`` (retrying cannot help)
router's TLS certificate fails verification ──▶ raises ``UntrustedRouter`` (nor can it here)

``ALLOWED`` is that diagram as a table (``shoal.lifecycle``); any other move raises
``IllegalTransition``.

Given several routers (on one Redis, ``Routers``), the link dials the next one whenever a
connection ends or fails, without delay until each was tried, then with the backoff.

Jobs survive a lost connection: they go on running and their output is held (``Outbox``);
the registration with the next router lists them (``Register.running``) and that router
resumes or cancels each. Jobs no router took back within ``DETACHED_GRACE_S`` are cancelled.

A ``wss://`` router is verified against the system's CAs, or the one CA given (``--tls-ca``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Protocol
from urllib.parse import urlsplit

import websockets
from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection

from shoal.lifecycle import Lifecycle, Transitions
from shoal.protocol.messages import (
    BackendState,
    CacheChanged,
    Draining,
    ErrorBody,
    Heartbeat,
    HeartbeatInterval,
    JobCancel,
    JobFailed,
    JobResume,
    JobStart,
    Message,
    ModelControl,
    ModelInfo,
    ModelsChanged,
    RefusalCode,
    Refused,
    Register,
    Registered,
    RouterMessage,
    StateChanged,
    decode_router_message,
    encode,
)
from shoal.protocol.shards import ShardStart, ShardState, ShardStatus, ShardStop, TunnelDial
from shoal.worker.backoff import Backoff
from shoal.worker.hardware import MemoryProbe
from shoal.worker.jobs.runner import JobRunner
from shoal.worker.link.dialing import advice, failure_reason, refusal_text
from shoal.worker.link.heartbeats import Heartbeats
from shoal.worker.link.outbox import Outbox
from shoal.worker.tls import Refusal, UntrustedRouter

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
STABLE_AFTER_S = 30.0
"""A connection that lasted this long resets the backoff."""
FATAL_REFUSALS = {RefusalCode.BAD_KEY, RefusalCode.PROTOCOL_VERSION}
NEVER_REACHED_WARN_AFTER = 3
"""Failed rounds (every router tried once) before a worker that never registered warns, once,
naming what it dials and what to check; the retries before and after are INFO lines."""
DETACHED_GRACE_S = 60.0
"""How long jobs run on without a router (longer than a router's lease on them: after that
no router can take them back)."""


class LinkState(enum.StrEnum):
    CONNECTING = "connecting"
    REGISTERED = "registered"
    WAITING = "waiting"


ALLOWED = Transitions(
    {
        LinkState.WAITING: frozenset({LinkState.CONNECTING}),
        LinkState.CONNECTING: frozenset({LinkState.REGISTERED, LinkState.WAITING}),
        LinkState.REGISTERED: frozenset({LinkState.WAITING}),
    }
)


class RouterRefused(Refusal):
    """The router answered the registration with ``refused``; ``keyed``: with a key given."""

    def __init__(self, refused: Refused, url: str, *, keyed: bool) -> None:
        super().__init__(
            refusal_text(refused, url, keyed=keyed), fatal=refused.code in FATAL_REFUSALS
        )
        self.refused = refused


_TLS_HINT = (
    "If a private CA signed the router's certificate, give this worker that CA's certificate "
    "with --tls-ca; check also that the host in --router-url is one the certificate names."
)


class Routers:
    """The routers a worker dials, in turn, and how: its key, and the TLS context that
    verifies a ``wss://`` router (``client_tls_context``; ws:// ignores it)."""

    def __init__(self, urls: Sequence[str], gpu_key: str | None, tls: ssl.SSLContext) -> None:
        if not urls:
            raise ValueError("a worker needs at least one router URL")
        self.urls = tuple(urls)
        self.gpu_key = gpu_key
        self.tls = tls
        self.url = self.urls[0]
        """The router dialed now (or last)."""

    def turn(self, n: int) -> str:
        """Dial the ``n``-th router (counting on past the last one: round robin) from now."""
        self.url = self.urls[n % len(self.urls)]
        return self.url

    def host(self) -> str:
        """The host of the router dialed now: its tunnel listener is there too."""
        return urlsplit(self.url).hostname or "127.0.0.1"


def _why(failure: BaseException) -> str:
    """A non-fatal refusal says it all; anything else is worded by ``failure_reason``."""
    return str(failure) if isinstance(failure, Refusal) else failure_reason(failure)


class ShardOrders(Protocol):
    """Where the router's orders about split models go (``worker.shards.ShardHost``)."""

    def start(self, spec: ShardStart) -> None: ...

    def stop(self, deployment: str) -> None: ...

    def dial(self, msg: TunnelDial) -> None: ...


class NoShards:
    """``ShardOrders`` of a worker that cannot take part in split models: a shard the router
    asks for fails at once with ``reason`` (not at the router's timeout)."""

    def __init__(self, reason: str, send: Callable[[Message], None]) -> None:
        self.reason = reason
        self._send = send

    def start(self, spec: ShardStart) -> None:
        log.warning("the router sent %s, but %s", spec.type, self.reason)
        failed = ShardStatus(
            deployment=spec.deployment, role=spec.role, state=ShardState.FAILED, detail=self.reason
        )
        self._send(failed)

    def stop(self, deployment: str) -> None:
        log.warning("the router sent shard_stop for %s, but %s", deployment, self.reason)

    def dial(self, msg: TunnelDial) -> None:
        log.warning("the router sent %s, but %s", msg.type, self.reason)


def _honour_lost_cancel() -> None:
    """Raise ``CancelledError`` if this task was told to stop and the request got lost.

    On Python 3.11 a TaskGroup whose child fails just as its task is cancelled from outside
    (the router closes the connection at the moment the worker's drain ends and stops it)
    raises the child's error and drops the cancellation: the link would dial on forever.
    The request is still counted (``Task.cancelling``), so it is honoured here.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class RouterLink:
    def __init__(
        self,
        routers: Routers,
        register: Callable[[], Register],
        runner: JobRunner,
        outbox: Outbox,
        *,
        memory: MemoryProbe,
        shards: ShardOrders,
        model_control: Callable[[ModelControl], bool],
        backoff: Backoff | None = None,
    ) -> None:
        """``register`` describes the worker (id, models, slots...) at each registration;
        ``shards`` takes the router's orders about split models (``NoShards`` when this
        worker cannot run them); ``model_control`` loads or unloads a model on request,
        False when it serves no such model."""
        self.routers = routers
        self.register = register
        self.worker_id = register().worker_id
        self.runner = runner
        self.outbox = outbox
        self.memory = memory
        self.shards = shards
        self.model_control = model_control
        self.backoff = backoff or Backoff()
        self._life = Lifecycle(
            f"router link of worker {self.worker_id}", ALLOWED, LinkState.WAITING, log
        )
        self.backend_state = BackendState.LOADING
        self.cached_blocks: tuple[int, ...] = ()
        """What llama-server's slots hold (``CacheChanged``), sent again in heartbeats."""
        self.default_model: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        """The router's default model, from the first ``registered`` reply."""
        self._grace: asyncio.TimerHandle | None = None
        self._draining: Draining | None = None
        """Set once the worker drains (``drain``): told to every router it registers with."""
        self._heartbeats: Heartbeats | None = None
        """This connection's heartbeats (None between connections)."""

    @property
    def state(self) -> LinkState:
        return self._life.state

    @property
    def url(self) -> str:
        """The router dialed now (or last)."""
        return self.routers.url

    def _move(self, state: LinkState, why: str) -> None:
        self._life.move(state, why)

    def on_models(self, models: tuple[ModelInfo, ...]) -> None:
        """The worker now serves ``models``; later registrations carry them too."""
        if self.state is LinkState.REGISTERED:
            self.outbox.send(ModelsChanged(models=models))

    def on_backend_state(self, state: BackendState, detail: str) -> None:
        self.backend_state = state
        if self.state is LinkState.REGISTERED:
            url = self.register().backend_url  # a restarted llama-server has a new port
            self.outbox.send(StateChanged(state=state, detail=detail, backend_url=url))

    def on_cache(self, blocks: tuple[int, ...]) -> None:
        self.cached_blocks = blocks
        if self.state is LinkState.REGISTERED:
            self.outbox.send(CacheChanged(blocks=blocks))

    def drain(self, timeout_s: float) -> None:
        """The worker stops once its jobs are answered: the router sends it no new job."""
        self._draining = Draining(timeout_s=timeout_s)
        if self.state is LinkState.REGISTERED:
            self.outbox.send(self._draining)

    async def run(self) -> None:
        attempt = turn = 0
        while True:
            url = self.routers.turn(turn)
            self._move(LinkState.CONNECTING, f"to {url} (attempt {attempt + 1})")
            connected = time.monotonic()
            failure: BaseException | None = None
            try:
                await self._session()
            except Refusal as refusal:
                if refusal.fatal:
                    raise
                failure = refusal
            except (OSError, TimeoutError, websockets.WebSocketException) as exc:
                failure = exc
            finally:
                self._detach()
            _honour_lost_cancel()
            if time.monotonic() - connected > STABLE_AFTER_S:
                attempt = 0
            delay = self.backoff.failover_delay(attempt, len(self.routers.urls))
            attempt += 1
            turn += 1
            why = "router closed the connection" if failure is None else _why(failure)
            if not self.default_model.done() and turn == self._warn_at:
                self._warn_never_reached(turn, why, failure)
            self._move(LinkState.WAITING, f"{why}; reconnecting in {delay:.1f} s")
            await asyncio.sleep(delay)

    @property
    def _warn_at(self) -> int:
        return NEVER_REACHED_WARN_AFTER * len(self.routers.urls)

    def _warn_never_reached(self, attempts: int, why: str, failure: BaseException | None) -> None:
        log.warning(
            "worker %s has not joined a router after %d attempts (dialing %s; last: %s). %s "
            "Retrying.",
            self.worker_id,
            attempts,
            ", ".join(self.routers.urls),
            why,
            advice(failure),
        )

    def _detach(self) -> None:
        """Keep the jobs running, their output held, for a router to take them back."""
        self.outbox.detach()
        held = self.outbox.held()
        if not held:
            return
        log.info(
            "%d job(s) go on without a router; cancelled if none takes them back in %.0f s",
            len(held),
            DETACHED_GRACE_S,
        )
        if self._grace is not None:
            self._grace.cancel()
        self._grace = asyncio.get_running_loop().call_later(DETACHED_GRACE_S, self._abandon)

    def _abandon(self) -> None:
        """Cancel the jobs still held: no router resumed them in time."""
        self._grace = None
        for job in self.outbox.held():
            log.warning("job %s: no router took it back; cancelled", job.job_id)
            self.outbox.discard(job.job_id)
            self.runner.cancel(job.job_id)

    async def _session(self) -> None:
        key = self.routers.gpu_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        tls = self.routers.tls if self.url.startswith("wss:") else None
        try:
            async with websockets.connect(
                self.url,
                additional_headers=headers,
                open_timeout=HANDSHAKE_TIMEOUT_S,
                ping_interval=20,
                ping_timeout=20,
                max_size=64 * 1024 * 1024,
                compression=None,
                ssl=tls,
            ) as ws:
                await self._registered(ws)
        except ssl.SSLCertVerificationError as exc:
            raise UntrustedRouter(
                f"cannot verify the TLS certificate of the router at {self.url} "
                f"({exc.verify_message}). {_TLS_HINT}"
            ) from None

    async def _registered(self, ws: ClientConnection) -> None:
        """Register, then serve the connection until it closes."""
        registered = await self._handshake(ws)
        self._move(LinkState.REGISTERED, f"with {self.url} as {registered.worker_id}")
        if not self.default_model.done():
            self.default_model.set_result(registered.default_model)
        # Frames queued while there was no router are stale (the registration said it all);
        # the held jobs' output stays in their journals until the router resumes each one,
        # or cancels it (``_abandon`` drops any it ignored).
        self.outbox.detach()
        if self.cached_blocks:
            self.outbox.send(CacheChanged(blocks=self.cached_blocks))
        if self._draining is not None:
            self.outbox.send(self._draining)
        beats = Heartbeats(
            registered.heartbeat_interval_s,
            self._reading,
            self.outbox.send,
            busy=lambda: self.runner.running > 0,
        )
        self._heartbeats = beats
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.outbox.pump(ws.send))
                tg.create_task(beats.run())
                await self._read(ws)
                raise websockets.ConnectionClosedOK(None, None)  # stop the other two
        except* (OSError, websockets.WebSocketException) as group:
            raise group.exceptions[0] from None
        finally:
            self._heartbeats = None

    async def _handshake(self, ws: ClientConnection) -> Registered:
        register = self.register()
        held = self.outbox.held()
        if held:
            register = register.model_copy(update={"running": held})
            log.info("asking the router to take back %d job(s)", len(held))
        with contextlib.suppress(websockets.ConnectionClosed):
            # A router that refuses (a bad key) may have closed before this frame left: its
            # ``refused``, which came first, is still there to read.
            await ws.send(encode(register))
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            reply = decode_router_message(await ws.recv())
        if isinstance(reply, Refused):
            raise RouterRefused(reply, self.url, keyed=self.routers.gpu_key is not None)
        if not isinstance(reply, Registered):
            raise websockets.InvalidMessage(f"expected 'registered', got {reply.type!r}")
        return reply

    async def _reading(self) -> Heartbeat:
        """A heartbeat: the backend's state, the jobs running, the machine's memory now."""
        reading = await self.memory.read()
        return Heartbeat(
            state=self.backend_state,
            running_jobs=self.runner.running,
            ram_available_bytes=reading.ram_available_bytes,
            gpu_free_bytes=reading.gpu_free_bytes,
            stage_memory_bytes=self.memory.stage_memory(),
            shard_devices=self.memory.shard_devices(),
            cached_blocks=self.cached_blocks,
            gpu_telemetry=reading.gpus,
        )

    def _refuse_draining(self, job: JobStart) -> None:
        """A job sent before the router heard that we drain: it runs elsewhere."""
        log.info("job %s: refused, worker %s is draining", job.job_id, self.worker_id)
        error = ErrorBody(
            message="The worker is stopping; the request runs on another worker.",
            type="server_error",
            code="worker_draining",
        )
        self.outbox.send(JobFailed(job_id=job.job_id, status=503, error=error, retryable=True))

    def _start(self, job: JobStart) -> None:
        if self._draining is not None:
            self._refuse_draining(job)
            return
        self.outbox.open(job.job_id, job.attempt)
        self.runner.start(job)
        if self._heartbeats is not None:
            self._heartbeats.poke()  # busy: it beats at the base interval now

    def _pace(self, msg: HeartbeatInterval) -> None:
        """The router's fleet grew or shrank: beat at its pace while idle."""
        log.info("the router asks for a heartbeat every %g s while idle", msg.seconds)
        if self._heartbeats is not None:
            self._heartbeats.set_idle(msg.seconds)

    def _model_control(self, msg: ModelControl) -> None:
        if not self.model_control(msg):
            log.warning(
                "the router asked to %s %s, which is not served here", msg.action, msg.model
            )

    async def _read(self, ws: ClientConnection) -> None:
        async for frame in ws:
            try:
                msg = decode_router_message(frame)
            except ValidationError as exc:
                log.warning("router sent a malformed frame; reconnecting: %s", exc)
                return
            self._handle(msg)

    def _handle(self, msg: RouterMessage) -> None:
        match msg:
            case JobStart():
                self._start(msg)
            case HeartbeatInterval():
                self._pace(msg)
            case JobCancel(job_id=job_id):
                self.outbox.discard(job_id)
                self.runner.cancel(job_id)
            case JobResume(job_id=job_id, from_chunk=from_chunk):
                if self.outbox.resume(job_id, from_chunk):
                    log.info("job %s: resumed from chunk %d", job_id, from_chunk)
            case ShardStart():
                self.shards.start(msg)
            case ShardStop(deployment=deployment):
                self.shards.stop(deployment)
            case TunnelDial():
                self.shards.dial(msg)
            case ModelControl():
                self._model_control(msg)
            case _:
                log.warning("unexpected %s frame from the router", msg.type)
