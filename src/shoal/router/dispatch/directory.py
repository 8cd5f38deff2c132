"""The cluster's worker list, shared by every router on one Redis.

Each router writes a hash per worker connected to it (``redis_queue.keys.worker_key``: its
``summary`` as JSON, with the prefix blocks its slots hold, and the ``router`` holding
it), with a TTL it refreshes every sync, and deletes it when the worker disconnects; a
router that dies leaves hashes that expire. Each sync also reads every worker hash (through
the ``worker_index_key`` set, never ``SCAN``), so ``remote`` is the other routers' workers
as of the last sync (pull workers' entries too). A sync runs every ``interval_s``, at once
after ``changed()`` (a worker joined or left here), and after ``soon()`` (a job started or
ended here, a job this router sent ended anywhere, or a worker's slots hold something new)
at most every ``PUSH_GAP_S``: what a worker holds and how busy it is reach the other routers
promptly, bounded in rate (and both no sooner than ``SYNC_PAUSE`` times the last sync's
duration after it: a sync is O(this router's workers), and thousands joining must not make
it run back to back). They read it at their own next sync (their interval, or a change of
theirs).

``hold_for`` is who should claim a job with a given prefix (``scheduler.hold_for`` over this
router's workers and every other one listed): the router holding the worker, or a pull worker
itself, each by its name in the queue's consumer group (``RemoteWorker.claimer``), which is
what the claim script compares a job's hold with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from shoal.protocol.ids import ModelName, WorkerId
from shoal.protocol.messages import BackendState, Endpoint, ModelInfo
from shoal.redis_queue.keys import worker_index_key, worker_key
from shoal.redis_queue.support import (
    REDIS_DOWN,
    RETRY_MAX_DELAY_S,
    OutageLog,
    raise_if_cancelled,
    text,
)
from shoal.router.dispatch.scheduler import ModelLoad, WorkerLoad, contexts_of, hold_for
from shoal.router.dispatch.workers import Registry

log = logging.getLogger(__name__)

PUSH_GAP_S = 0.2
"""The least time between two syncs brought on by ``soon()`` (jobs starting and ending)."""
SYNC_PAUSE = 4.0
"""A sync that took T seconds is followed by one brought on by a change no sooner than
``SYNC_PAUSE`` x T later: however large the fleet (a sync is O(its workers)), syncing takes
at most a fifth of the router's time while workers join (each join is a ``changed()``)."""
_TAKES_JOBS = frozenset({BackendState.READY, BackendState.UNLOADED})
_LOADED_BY_A_JOB = frozenset({BackendState.UNLOADED, BackendState.FAILED})


@dataclass(frozen=True, slots=True)
class RemoteWorker:
    """A worker connected to another router, as that router last wrote it."""

    id: WorkerId
    router: str
    state: BackendState
    connected_at: float
    models: tuple[ModelInfo, ...]
    summary: dict[str, Any]
    cached: frozenset[int] = frozenset()
    """The prefix hashes its llama-server's slots hold (``protocol.prefix``), as of the last
    sync of the router holding it (or of the pull worker itself)."""

    def serves(self, model: ModelName, endpoint: Endpoint | None = None) -> bool:
        return any(
            m.name == model and (endpoint is None or endpoint in m.endpoints) for m in self.models
        )

    @property
    def draining(self) -> bool:
        """It is stopping: it takes no new job (``Draining``)."""
        return bool(self.summary.get("draining", False))

    @property
    def ready(self) -> bool:
        """Its backend is ready and it is not draining."""
        return self.state is BackendState.READY and not self.draining

    @property
    def takes_jobs(self) -> bool:
        """Ready, or unloaded after idling (it loads on the next job), and not draining."""
        return self.state in _TAKES_JOBS and not self.draining

    @property
    def pulls(self) -> bool:
        """A pull worker: it claims its jobs from Redis itself (no router holds it)."""
        return self.summary.get("connection") == "redis-pull"

    @property
    def claimer(self) -> str | None:
        """Who claims its jobs from Redis, by its consumer name (what a job is held for): the
        router holding it, or a pull worker itself (the ``consumer`` its entry names; None if
        the entry names none)."""
        if not self.pulls:
            return self.router
        consumer = self.summary.get("consumer")
        return consumer if isinstance(consumer, str) and consumer else None

    def residency(self) -> tuple[ModelLoad, ...]:
        """Its models that report a state of their own, each with its running jobs as its
        entry says (``running_by_model``; an entry without them, an older worker's, counts
        every job of the worker against each: never ranked freer than it is); one not loaded
        with a job of its own there is loading. This router gave none of them a job
        (``last_assigned`` 0)."""
        by_model = self.summary.get("running_by_model")
        counts = by_model if isinstance(by_model, dict) else {}
        everything = int(self.summary.get("running_jobs", 0))
        out = []
        for m in self.models:
            if m.state is None:
                continue
            running = int(counts.get(m.name, everything if not counts else 0))
            state = m.state
            if running and counts and state in _LOADED_BY_A_JOB:
                state = BackendState.LOADING  # its job loads it (``WorkerConnection.residency``)
            out.append(ModelLoad(m.name, state, m.slots, running, m.resident_bytes, m.pinned))
        return tuple(out)

    @property
    def model_budget_bytes(self) -> int | None:
        budget = self.summary.get("model_budget_bytes")
        return int(budget) if isinstance(budget, int) else None

    def load(self) -> WorkerLoad:
        """What the scheduler knows of it, as of its router's last sync."""
        return WorkerLoad(
            id=self.id,
            ready=self.takes_jobs,
            loaded=self.ready,
            models=frozenset((m.name, e) for m in self.models for e in m.endpoints),
            slots=int(self.summary.get("slots", 0)),
            running=int(self.summary.get("running_jobs", 0)),
            cached=self.cached,
            contexts=contexts_of(self.models),
            residency=self.residency(),
            budget=self.model_budget_bytes,
        )


def parse_remote(worker_id: str, router: str, raw: bytes | str) -> RemoteWorker | None:
    """A worker hash's fields as a ``RemoteWorker``; None (logged) if it cannot be read."""
    try:
        summary: dict[str, Any] = orjson.loads(raw)
        models = tuple(ModelInfo.model_validate(m) for m in summary.get("models", ()))
        return RemoteWorker(
            id=WorkerId(worker_id),
            router=router,
            state=BackendState(summary["state"]),
            connected_at=float(summary.get("connected_at", 0.0)),
            models=models,
            summary={**summary, "router": router},
            cached=frozenset(int(h) for h in summary.get("cached_blocks", ())),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        log.warning("worker %s: unreadable entry from router %s: %s", worker_id, router, exc)
        return None


class WorkerDirectory:
    """Publishes this router's workers to Redis and reads every other router's."""

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        router: str,
        registry: Registry,
        *,
        interval_s: float,
        outage: OutageLog | None = None,
    ) -> None:
        self.router = router
        self.outage = outage or OutageLog()
        self.remote: list[RemoteWorker] = []
        self.heard_at: float | None = None
        """``time.monotonic()`` when the last sync that found another router's worker ended."""
        self._redis = redis
        self._prefix = prefix
        self._registry = registry
        self._interval_s = interval_s
        self._ttl_ms = int(interval_s * 3000) + 1000  # three missed syncs and it is gone
        self._written: dict[str, int] = {}
        """Each worker written, with the hash of its entry as written (``sync``)."""
        self._changed = asyncio.Event()
        self._now = False  # changed() since the last sync, not only soon()
        self._synced_at = 0.0

    def changed(self) -> None:
        """A worker joined or left this router: sync now rather than at the next interval."""
        self._now = True
        self._changed.set()

    def soon(self) -> None:
        """A job started or ended here, or a worker's slots hold something new: sync within
        ``PUSH_GAP_S`` of the last sync (several changes share one)."""
        self._changed.set()

    def hold_for(
        self, model: ModelName, endpoint: Endpoint, prefix: tuple[int, ...], need: int = 0
    ) -> str | None:
        """The consumer (a router, or a pull worker) whose worker should run a job with
        ``prefix`` and ``need`` (``scheduler.hold_for``), over this router's workers as they
        are and the others as of the last sync (``RemoteWorker.claimer``); only those serving
        ``model`` for ``endpoint`` (``scheduler.hold_for`` passes over the others)."""
        owned = [(self.router, w.load()) for w in self._registry.serving(model, endpoint)]
        owned += [
            (c, r.load())
            for r in self.remote
            if (c := r.claimer) is not None and r.serves(model, endpoint)
        ]
        return hold_for(owned, model, endpoint, prefix, need)

    async def run(self) -> None:
        delay = self._interval_s
        try:
            while True:
                started = time.monotonic()
                try:
                    await self.sync()
                    delay = self._interval_s
                    self.outage.succeeded()
                except REDIS_DOWN as exc:
                    self.outage.failed("worker directory", exc)
                    delay = min(delay * 2, RETRY_MAX_DELAY_S)
                raise_if_cancelled()
                self._synced_at = time.monotonic()
                took = self._synced_at - started
                self._now = False
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._changed.wait()
                least = SYNC_PAUSE * took if self._now else max(PUSH_GAP_S, SYNC_PAUSE * took)
                gap = self._synced_at + least - time.monotonic()
                if gap > 0:
                    await asyncio.sleep(gap)  # the rate bound: later changes join in
                self._changed.clear()
        finally:
            with contextlib.suppress(*REDIS_DOWN):
                await self._forget(set(self._written))

    async def sync(self) -> None:
        """Write this router's workers, delete the ones that left, read the others'.

        A worker whose entry has not changed since it was last written (all but how long ago
        it was heard from) only has its TTL renewed: an idle fleet costs a ``PEXPIRE`` per
        worker per sync, not a rewrite (its ``last_seen_s_ago`` there is as of its last
        write; the TTL says it is alive). An entry gone from Redis (its ``PEXPIRE`` found
        nothing) is written again at the next sync."""
        index = worker_index_key(self._prefix)
        written: dict[str, int] = {}
        renewed: list[tuple[str, int]] = []  # (worker, where its PEXPIRE's reply is)
        commands = 0
        async with self._redis.pipeline(transaction=False) as pipe:
            for w in self._registry:
                summary = w.summary()
                seen = summary.pop("last_seen_s_ago")
                stamp = hash(orjson.dumps(summary))
                key = worker_key(self._prefix, w.id)
                written[w.id] = stamp
                if self._written.get(w.id) != stamp:
                    summary["last_seen_s_ago"] = seen
                    entry = orjson.dumps(summary)
                    pipe.hset(key, mapping={"router": self.router, "summary": entry})
                    pipe.sadd(index, w.id)
                    commands += 2
                else:
                    renewed.append((w.id, commands))
                pipe.pexpire(key, self._ttl_ms)
                commands += 1
            replies = await pipe.execute()
        for worker_id, at in renewed:
            if not replies[at]:
                del written[worker_id]  # its entry is gone from Redis: written next time
        await self._forget(set(self._written) - set(written))
        self._written = written
        self.remote = await self._read_all(index, skip=written.keys())
        if self.remote:
            self.heard_at = time.monotonic()

    async def _forget(self, worker_ids: set[str]) -> None:
        if worker_ids:
            await self._unlink_mine(sorted(worker_ids))

    async def _unlink_mine(self, worker_ids: list[str]) -> None:
        """Delete the hashes of workers that left, unless another router holds them now."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                pipe.hget(worker_key(self._prefix, worker_id), "router")
            owners = await pipe.execute()
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id, owner in zip(worker_ids, owners, strict=True):
                if owner is not None and text(owner) == self.router:
                    pipe.unlink(worker_key(self._prefix, worker_id))
            await pipe.execute()

    async def _read_all(self, index: str, skip: Collection[str]) -> list[RemoteWorker]:
        """Every worker listed but this router's own (``skip``: it knows them already)."""
        ids = sorted(i for i in map(text, await self._redis.smembers(index)) if i not in skip)
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id in ids:
                pipe.hmget(worker_key(self._prefix, worker_id), ["router", "summary"])
            rows = await pipe.execute()
        remote: list[RemoteWorker] = []
        expired: list[str] = []
        for worker_id, (router, summary) in zip(ids, rows, strict=True):
            if router is None or summary is None:
                expired.append(worker_id)
            elif text(router) != self.router:
                entry = parse_remote(worker_id, text(router), summary)
                if entry is not None:
                    remote.append(entry)
        if expired:
            await self._redis.srem(index, *expired)
        return remote
