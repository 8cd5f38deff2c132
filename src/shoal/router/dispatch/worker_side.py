"""What this router's workers say, routed the same way for both dispatchers.

A worker's WebSocket handler (``routes/worker_socket.py``) hands every frame here: job output
goes to ``Running``, the rest updates the worker's connection. Two things differ between the
dispatchers and are passed in: what to do with the jobs a reconnecting worker still runs
(``reattach``: in-process they ended with its old connection, so they are cancelled; with
Redis they are adopted and resumed), and whom to tell that this router's workers changed
(``changed``: the Redis worker directory).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from shoal.protocol.messages import (
    BackendState,
    CacheChanged,
    ChunkItem,
    Chunks,
    Draining,
    Heartbeat,
    JobCancel,
    JobDone,
    JobFailed,
    JobLoading,
    JobResult,
    ModelsChanged,
    Register,
    RunningJob,
    StateChanged,
    WorkerMessage,
)
from shoal.router.dispatch.heartbeats import HeartbeatPace
from shoal.router.dispatch.running import Running
from shoal.router.dispatch.workers import Registry, WorkerConnection

log = logging.getLogger(__name__)

Reattach = Callable[[WorkerConnection, Sequence[RunningJob]], None]


def cancel_held(worker: WorkerConnection, held: Sequence[RunningJob]) -> None:
    """``Reattach`` for a router whose jobs end with their worker's connection."""
    for running in held:
        log.info("job %s: worker %s still runs it; cancelled", running.job_id, worker.id)
        worker.send(JobCancel(job_id=running.job_id))


def nobody() -> None:
    """``changed`` for a router that tells no one (no Redis)."""


class WorkerSide:
    def __init__(
        self,
        registry: Registry,
        running: Running[Any],
        capacity: Callable[[], None],
        *,
        reattach: Reattach = cancel_held,
        changed: Callable[[], None] = nobody,
        cache_changed: Callable[[], None] = nobody,
        pace: HeartbeatPace | None = None,
    ) -> None:
        """``capacity``: a slot may have freed or a worker joined (place waiting jobs);
        ``changed``: a worker joined, left or changed state; ``cache_changed``: what a
        worker's slots hold changed, or a job ended on it (tell the other routers soon);
        ``pace``: how often idle workers heartbeat for the fleet's size (default: every 5 s
        up to 250 heartbeats a second)."""
        self.registry = registry
        self.pace = pace or HeartbeatPace(5.0, 250.0)
        self.running = running
        self._capacity = capacity
        self._reattach = reattach
        self._changed = changed
        self._cache_changed = cache_changed

    def on_registered(self, worker: WorkerConnection, held: Sequence[RunningJob] = ()) -> None:
        """A worker joined; ``held``: jobs it still runs from a connection it lost."""
        self.registry.add(worker)
        self._pace(worker)
        self._changed()
        if held:
            self._reattach(worker, held)
        self._capacity()

    def on_lost(self, worker: WorkerConnection, why: str, reason: str = "connection") -> None:
        """A worker's connection ended: its jobs run again elsewhere, go on elsewhere or
        fail (``Running``); ``reason``: how it was lost (connection, heartbeat, stall)."""
        self.registry.remove(worker)
        self.running.on_lost(worker, why, time.monotonic(), reason)
        self._pace(None)
        self._changed()

    def _pace(self, joined: WorkerConnection | None) -> None:
        """Keep the idle fleet's heartbeats within the router's budget: every worker is told
        when the interval changes (O(workers), a handful of times as a fleet grows or
        shrinks by factors of two), a worker that joins is told the interval in force."""
        interval = self.pace.after(len(self.registry))
        if interval is not None:
            log.info(
                "%d workers: idle workers heartbeat every %g s (--heartbeat-rate %g/s)",
                len(self.registry),
                interval,
                self.pace.rate,
            )
            for worker in self.registry:
                worker.pace(interval)
        elif joined is not None and self.pace.interval != self.pace.base:
            joined.pace(self.pace.interval)  # it was told the base (``Registered``)

    def on_chunks(self, worker: WorkerConnection, items: list[ChunkItem]) -> None:
        """Streamed chunks (the hot path: decoded without a model per chunk)."""
        now = worker.last_seen = time.monotonic()
        for job_id, data, tokens in items:
            self.running.on_chunk(worker, job_id, data, tokens, now)

    def on_message(self, worker: WorkerConnection, msg: WorkerMessage) -> None:
        now = worker.last_seen = time.monotonic()
        match msg:
            case Chunks(items=items):
                for item in items:
                    self.running.on_chunk(worker, item.job_id, item.data, item.tokens, now)
            case JobLoading():
                self.running.on_loading(worker, msg, now)
            case JobDone() | JobResult():
                self.running.on_end(worker, msg, now)
                self._cache_changed()
            case JobFailed():
                self.running.on_failed(worker, msg, now)
                self._cache_changed()
            case Heartbeat() | StateChanged() | Draining():
                self._on_status(worker, msg)
            case CacheChanged(blocks=blocks):
                worker.set_cached(blocks)
                self._cache_changed()
            case ModelsChanged(models=models):
                worker.set_models(models)
                self._changed()
                self._capacity()
            case Register():
                raise ValueError("register sent twice")

    def _on_status(
        self, worker: WorkerConnection, msg: Heartbeat | StateChanged | Draining
    ) -> None:
        """What the worker says of itself: its backend's state, its memory, that it drains."""
        match msg:
            case Heartbeat(state=state):
                worker.on_heartbeat(msg)
                self._on_state(worker, state, worker.detail, worker.backend_url)
            case StateChanged(state=state, detail=detail, backend_url=backend_url):
                self._on_state(worker, state, detail, backend_url)
            case Draining(timeout_s=timeout_s):
                worker.drain(timeout_s)
                self._changed()

    def _on_state(
        self, worker: WorkerConnection, state: BackendState, detail: str, backend_url: str | None
    ) -> None:
        was_available = worker.available
        changed = state is not worker.backend_state
        worker.set_backend_state(state, detail, backend_url)
        if changed:
            self._changed()
        if worker.available and not was_available:
            self._capacity()
