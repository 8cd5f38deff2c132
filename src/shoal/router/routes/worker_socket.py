"""The WebSocket workers dial into: handshake, then one reader, one writer, one watchdog."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

import orjson
from fastapi import APIRouter, WebSocket
from pydantic import ValidationError
from starlette.websockets import WebSocketDisconnect

from shoal import __version__
from shoal.protocol.messages import (
    CLOSE_HEARTBEAT_TIMEOUT,
    CLOSE_PROTOCOL_ERROR,
    CLOSE_REFUSED,
    PROTOCOL_VERSION,
    WS_PATH,
    RefusalCode,
    Refused,
    Register,
    Registered,
    ShardLinks,
    ShardStatus,
    decode_chunk_items,
    decode_worker_message,
    encode,
)
from shoal.router.dispatch.interface import Dispatcher
from shoal.router.dispatch.workers import ConnState, WorkerConnection
from shoal.router.routes.context import RouterContext, context
from shoal.router.routes.watchdog import HeartbeatMissed, Stalled, Watchdog
from shoal.tls_listener import PeerWarnings

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 10.0
CLOSE_POLICY_VIOLATION = 1008
"""The standard close code for a connection this server does not serve (RFC 6455)."""

router = APIRouter()


class Refusal(Exception):
    def __init__(self, code: RefusalCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class ProtocolViolation(Exception):
    pass


def _peer(ws: WebSocket) -> str:
    return f"{ws.client.host}:{ws.client.port}" if ws.client else "?"


def parse_register(frame: str, ctx: RouterContext) -> Register:
    """Check the first frame: protocol version first, so old and new workers get a clear no."""
    try:
        raw = orjson.loads(frame)
    except orjson.JSONDecodeError:
        raise Refusal(RefusalCode.BAD_REGISTRATION, "first frame is not JSON") from None
    version = raw.get("protocol_version") if isinstance(raw, dict) else None
    if version != PROTOCOL_VERSION:
        raise Refusal(
            RefusalCode.PROTOCOL_VERSION,
            f"this router (Shoal {__version__}) speaks worker protocol {PROTOCOL_VERSION}, "
            f"the worker speaks {version}; run the same Shoal version on both",
        )
    try:
        msg = decode_worker_message(frame)
    except ValidationError as exc:
        raise Refusal(RefusalCode.BAD_REGISTRATION, f"invalid register: {exc}") from None
    if not isinstance(msg, Register):
        raise Refusal(RefusalCode.BAD_REGISTRATION, "the first frame must be 'register'")
    existing = ctx.registry.get(msg.worker_id)
    if existing is not None and existing.conn_state is ConnState.ACTIVE:
        raise Refusal(RefusalCode.DUPLICATE_ID, f"worker id {msg.worker_id} is already connected")
    return msg


@router.websocket(WS_PATH)
async def worker_socket(ws: WebSocket) -> None:
    """The documented route; the router serves it ahead of FastAPI (``serve_worker``)."""
    await serve_worker(ws, context(ws))


async def serve_worker(ws: WebSocket, ctx: RouterContext) -> None:
    """One worker's connection: key, registration, then its frames until it ends. Called by
    the composition root's ASGI fast path (``routes/inference.FastPath``) for ``WS_PATH``,
    without FastAPI's routing, dependencies and middleware (a fleet registers thousands)."""
    await ws.accept()
    peer = _peer(ws)
    try:
        if not await ctx.keys.worker(ws.headers):
            raise Refusal(RefusalCode.BAD_KEY, "the GPU key is missing or wrong (--gpu-key)")
        async with asyncio.timeout(REGISTER_TIMEOUT_S):
            msg = parse_register(await ws.receive_text(), ctx)
    except Refusal as refusal:
        log.warning("refused worker from %s: %s", peer, refusal.reason)
        await ws.send_text(encode(Refused(code=refusal.code, reason=refusal.reason)))
        await ws.close(CLOSE_REFUSED, refusal.reason[:120])
        return
    except (TimeoutError, WebSocketDisconnect):
        log.warning("worker from %s did not register", peer)
        await _close_quietly(ws, CLOSE_PROTOCOL_ERROR, "no register frame")
        return
    worker = WorkerConnection.from_register(msg, peer, ctx.settings.heartbeat_interval)
    worker.move(
        ConnState.ACTIVE,
        f"registered from {peer} with {msg.slots} slots, models "
        + ", ".join(m.name for m in msg.models),
    )
    worker.send(
        Registered(
            worker_id=worker.id,
            heartbeat_interval_s=ctx.settings.heartbeat_interval,
            router_version=__version__,
            default_model=ctx.settings.default_model,
        )
    )
    ctx.dispatcher.workers.on_registered(worker, msg.running)
    ctx.deployments.on_registered(worker)
    await _serve(ws, worker, ctx)


UNKNOWN_PATH_WARN_EVERY_S = 600.0
"""A WebSocket to a path that is not the workers' (a worker dialing the clients' /v1, from a
--router-url its version did not check) is logged once per path per this period."""
_unknown_paths = PeerWarnings(UNKNOWN_PATH_WARN_EVERY_S)
"""Which unknown paths were logged lately, for the whole process: a rate limit on the log."""


@router.websocket("/{path:path}")
async def unknown_socket(ws: WebSocket, path: str) -> None:
    """Any other WebSocket path: closed with a reason that names the workers' path, instead of
    the bare 403 a worker would retry forever without a word about why."""
    where = "/" + path
    await ws.accept()
    if _unknown_paths.due(where, time.monotonic()):
        log.warning(
            "a WebSocket to %s from %s was closed: workers dial %s (a worker's --router-url is "
            "host:port, without a path)",
            where,
            _peer(ws),
            WS_PATH,
        )
    reason = f"no worker socket at {where[:40]}: workers dial {WS_PATH} (--router-url HOST:PORT)"
    await _close_quietly(ws, CLOSE_POLICY_VIOLATION, reason)


async def _serve(ws: WebSocket, worker: WorkerConnection, ctx: RouterContext) -> None:
    """A registered worker's connection until it ends; then its jobs go elsewhere."""
    lost = False

    def lose(why: str, reason: str) -> None:
        """Its jobs go elsewhere at once (before a close a frozen peer may never answer)."""
        nonlocal lost
        if not lost:
            lost = True
            worker.move(ConnState.CLOSED, why)
            ctx.dispatcher.workers.on_lost(worker, why, reason)
            ctx.deployments.on_lost(worker)

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(_write(ws, worker))
            tg.create_task(_watch(worker, ctx))
            await _read(ws, worker, ctx)
            raise WebSocketDisconnect  # reader ended: tear the other two down
    except* WebSocketDisconnect:
        lose("connection closed", "connection")
    except* HeartbeatMissed:
        lose("heartbeats missed", "heartbeat")
        await _close_quietly(ws, CLOSE_HEARTBEAT_TIMEOUT, "heartbeats missed")
    except* Stalled:
        why = f"silent for {ctx.settings.stall_timeout:g} s while streaming (stall timeout)"
        lose(why, "stall")
        await _close_quietly(ws, CLOSE_HEARTBEAT_TIMEOUT, "stalled")
    except* ProtocolViolation as group:
        why = f"protocol violation: {group.exceptions[0]}"
        lose(why, "connection")
        await _close_quietly(ws, CLOSE_PROTOCOL_ERROR, why[:120])
    except* OSError:
        lose("connection broke", "connection")
    finally:
        lose("connection closed", "connection")


async def _read(ws: WebSocket, worker: WorkerConnection, ctx: RouterContext) -> None:
    workers = ctx.dispatcher.workers
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        frame = message.get("text") or message.get("bytes")
        if frame is None:
            continue
        try:
            items = decode_chunk_items(frame)
            if items is not None:
                workers.on_chunks(worker, items)
                continue
            msg = decode_worker_message(frame)
            if isinstance(msg, ShardStatus):
                ctx.deployments.on_shard(worker, msg)
            elif isinstance(msg, ShardLinks):
                ctx.deployments.on_links(worker, msg)
            else:
                workers.on_message(worker, msg)
        except (ValidationError, ValueError) as exc:
            log.warning("worker %s sent a malformed frame: %s", worker.id, exc)
            raise ProtocolViolation(str(exc).splitlines()[0]) from None


async def _write(ws: WebSocket, worker: WorkerConnection) -> None:
    outbox = worker.outbox
    while True:
        for frame in await outbox.take():
            await ws.send_text(frame)


async def _watch(worker: WorkerConnection, ctx: RouterContext) -> None:
    """Until its watchdog trips (``HeartbeatMissed``, ``Stalled``): one timer, no wake-ups
    per heartbeat (``routes/watchdog.py``)."""
    watchdog = Watchdog(
        worker,
        misses=ctx.settings.heartbeat_misses,
        stall_timeout=ctx.settings.stall_timeout,
        others=lambda: _others(ctx.dispatcher, worker),
    )
    watchdog.start()
    try:
        await watchdog.tripped
    finally:
        watchdog.stop()


def _others(dispatcher: Dispatcher, worker: WorkerConnection) -> Iterator[float]:
    """When each other worker was last heard from: this router's, and with Redis the
    cluster's (its last directory sync that found another router's worker).

    Lazy: ``frozen`` reads it only for a worker that holds jobs and has been silent for the
    stall timeout, so a watchdog's wake-up stays O(1) instead of walking every worker (which
    made an idle fleet's cost grow with its square)."""
    cluster = dispatcher.heard_from_cluster()
    if cluster is not None:
        yield cluster
    yield from (w.last_seen for w in dispatcher.workers.registry if w is not worker)


async def _close_quietly(ws: WebSocket, code: int, reason: str) -> None:
    with contextlib.suppress(RuntimeError, OSError):  # already closed by the peer
        await ws.close(code, reason)
