"""The text models of a worker serving several, kept loaded as its memory allows.

Each model is a ``HostedModel`` (its own llama-server, built UNLOADED). A job for model M
goes through ``hold(M)``, which:

- marks M busy (a model a job holds or waits for is never evicted);
- when M is not loaded, starts ONE load that every job for M waits on (single flight), and
  tells the router once per job (``JobLoading``: a streamed answer shows ``: loading``);
- the load asks ``shoal.models.residency.admit`` with M's footprint (measured on its last
  load, else the estimate) and the loaded models': ``Admit`` -> evict what it names (each
  told to the ``CacheKeeper`` first), then load; ``Wait`` -> wait until a job ends or a
  model unloads (an event) and decide again; ``Refuse`` -> ``ModelDoesNotFit``, which the
  job answers as a 503 ``model_does_not_fit`` that is not retried (the numbers say why);
- after a load, what llama-server reported replaces the estimate (``HostedModel.loaded``).

Decisions and evictions are taken under one lock, so two loads never count on the same free
bytes. Pinned models are never evicted; preloaded ones load at start, in the given order (one
that does not fit is logged, not fatal). A model's own idle time (``idle_unload``) unloads it
here, its slots saved first as for an eviction (``_unload_idle``). The worker's state is
``worker_state`` of its models'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Protocol

import aiohttp

from shoal.models.residency import Admit, Footprint, Refuse, Resident, Wait, admit
from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import (
    BackendState,
    ErrorBody,
    JobFailed,
    JobLoading,
    JobStart,
    ModelInfo,
)
from shoal.worker.jobs.runner import JobFunction
from shoal.worker.jobs.sink import JobSink
from shoal.worker.lifecycle import NotServing
from shoal.worker.text.residency.hosted import HostedModel
from shoal.worker.text.residency.planned import PlannedModel

log = logging.getLogger(__name__)

NOT_FIT_STATUS = 503
NOT_FIT_CODE = "model_does_not_fit"


class CacheKeeper(Protocol):
    """Keeps slots' KV caches across an eviction (``kv_saves.py``): saves them before a
    model's llama-server is stopped, restores them once it is loaded again."""

    async def before_unload(self, host: HostedModel) -> None: ...

    async def after_load(self, host: HostedModel) -> None: ...


class ModelDoesNotFit(Exception):
    """``admit`` refused the model: it cannot fit here, not even alone or beside the pinned
    ones (the message names the numbers)."""


def worker_state(states: Iterable[BackendState]) -> BackendState:
    """The worker's state from its text models': READY when one is; else UNLOADED when one
    is (a job for it loads it; the router sends jobs to UNLOADED workers); else LOADING while
    one loads or restarts; FAILED only when all failed."""
    seen = set(states)
    for state in (BackendState.READY, BackendState.UNLOADED, BackendState.LOADING):
        if state in seen:
            return state
    if BackendState.RESTARTING in seen:
        return BackendState.LOADING
    return BackendState.FAILED if seen else BackendState.LOADING


class TextModels:
    """Several text models on one worker, loaded and evicted by measured memory."""

    def __init__(
        self,
        planned: Sequence[PlannedModel],
        session: aiohttp.ClientSession,
        budget: Footprint,
        *,
        on_models: Callable[[], None],
        on_state: Callable[[BackendState, str], None],
        on_cache: Callable[[tuple[int, ...]], None],
        loading: Callable[[JobLoading], None] | None = None,
        keeper: CacheKeeper | None = None,
    ) -> None:
        """``loading``: where ``JobLoading`` goes (the router link; None: nowhere)."""
        self.budget = budget
        self.keeper = keeper
        self._on_models = on_models
        self._on_state = on_state
        self._on_cache = on_cache
        self._loading = loading
        self.hosts: dict[str, HostedModel] = {}
        for p in planned:
            host = HostedModel(
                p,
                session,
                on_state=self._moved,
                on_cache=self._cache,
            )
            self.hosts[host.name] = host
        self._lock = asyncio.Lock()
        """Held while deciding and evicting, so two loads never count the same free bytes."""
        self._freed = asyncio.Event()
        """Set (and replaced) when a job lets go of a model or a model unloads."""
        self._changed = asyncio.Event()
        """Set (and replaced) when a job lets go of a model or a model moves (idle times)."""
        self._state = self.state
        self._tg: asyncio.TaskGroup | None = None
        """Where loads and the router's load and unload orders run (``run``'s)."""
        self._running = asyncio.Event()
        """Set once ``run`` has its task group."""

    @property
    def state(self) -> BackendState:
        return worker_state(h.state for h in self.hosts.values())

    @property
    def slots(self) -> int:
        return sum(h.config.slots for h in self.hosts.values())

    def infos(self) -> tuple[ModelInfo, ...]:
        return tuple(h.info() for h in self.hosts.values())

    def summary(self) -> tuple[int, ...]:
        """Every model's slots' content hashes (a hash does not name its model)."""
        return tuple(sorted({b for h in self.hosts.values() for b in h.slots.summary()}))

    async def run(self) -> None:
        """Supervise every model's llama-server, load the preloaded ones, until cancelled."""
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            self._running.set()
            for host in self.hosts.values():
                tg.create_task(host.server.run())
                tg.create_task(host.pinning.run_measure())
            tg.create_task(self._unload_idle())
            for host in self.hosts.values():
                if host.preload:
                    try:
                        await self._ensure(host)
                    except (ModelDoesNotFit, NotServing) as exc:
                        log.warning("model %s: not preloaded: %s", host.name, exc)

    def job_function(self, model: str) -> JobFunction:
        """Runs a job of ``model``: holds it (loading it first, if need be), then its backend;
        a model that cannot fit fails the job (503 ``model_does_not_fit``, not retried)."""
        host = self.hosts[model]

        async def run(job: JobStart, out: JobSink) -> None:
            try:
                async with self.hold(model, job.job_id):
                    await host.backend.run(job, out)
            except ModelDoesNotFit as exc:
                log.warning("job %s model=%s: %s", job.job_id, model, exc)
                error = ErrorBody(message=str(exc), type="server_error", code=NOT_FIT_CODE)
                out.send(JobFailed(job_id=job.job_id, status=NOT_FIT_STATUS, error=error))

        return run

    @contextlib.asynccontextmanager
    async def hold(self, model: str, job_id: JobId | None = None) -> AsyncIterator[HostedModel]:
        """Hold ``model`` loaded for one job (see the module). Raises ``ModelDoesNotFit``,
        or ``NotServing`` when its llama-server fails for good."""
        host = self.hosts[model]
        host.holders += 1
        try:
            if (host.state is not BackendState.READY or host.unloading) and job_id is not None:
                log.info("job %s: waits while model %s loads", job_id, model)
                if self._loading is not None:
                    self._loading(JobLoading(job_id=job_id, model=ModelName(model)))
            await self._ensure(host)
            async with host.server.use():
                host.last_used = time.monotonic()
                yield host
        finally:
            host.holders -= 1
            host.last_used = time.monotonic()
            if not host.holders:
                self._free()

    async def _ensure(self, host: HostedModel) -> None:
        """Until ``host`` is READY: join its load, or start one (single flight). A model
        being unloaded (its slots saving, its process stopping) is let go first, then loaded
        again: no job is let through to a llama-server about to stop."""
        while host.state is not BackendState.READY or host.unloading:
            if host.unloading:
                await self._changed.wait()
                continue
            if host.state is BackendState.FAILED:
                raise NotServing(host.server.detail)
            if host.state is not BackendState.UNLOADED:  # loading or restarting on its own
                await host.server.load()
                continue
            if host.load is None:
                await self._running.wait()
                if host.load is None and host.state is BackendState.UNLOADED:
                    host.load = asyncio.get_running_loop().create_future()
                    assert self._tg is not None
                    self._tg.create_task(self._load_for_all(host, host.load))
                    continue
            if host.load is not None:
                await asyncio.shield(host.load)

    async def _load_for_all(self, host: HostedModel, done: asyncio.Future[None]) -> None:
        """``_load``, its outcome in ``done`` for every job that waits on it (a refusal or a
        failure is theirs, not the task group's)."""
        try:
            await self._load(host)
            done.set_result(None)
        except (ModelDoesNotFit, NotServing) as exc:
            done.set_exception(exc)
        finally:
            if not done.done():  # cancelled: the worker stops
                done.cancel()
            host.load = None
            self._free()

    async def _load(self, host: HostedModel) -> None:
        """Make room for ``host`` (``admit``), then load it."""
        while True:
            freed = self._freed
            async with self._lock:
                decision = admit(host.name, host.footprint, self._others(host), self.budget)
                if isinstance(decision, Refuse):
                    raise ModelDoesNotFit(decision.reason)
                if isinstance(decision, Admit):
                    for name in decision.evict:
                        await self._evict(self.hosts[name], f"evicted to load model {host.name}")
                    log.info(
                        "model %s: loading (needs %s of the budget %s)",
                        host.name,
                        host.footprint.describe(),
                        self.budget.describe(),
                    )
                    loaded = asyncio.ensure_future(host.server.load())
            if isinstance(decision, Wait):
                log.info("model %s: waits: %s", host.name, decision.reason)
                await freed.wait()
                continue
            await loaded
            if self.keeper is not None:
                await self.keeper.after_load(host)
            return

    def _others(self, host: HostedModel) -> list[Resident]:
        """The models loaded (or loading) besides ``host``."""
        return [h.as_resident() for h in self.hosts.values() if h is not host and h.resident]

    async def _evict(self, host: HostedModel, why: str) -> None:
        host.evictions += 1
        await self._unload(host, why)

    async def _unload_idle(self) -> None:
        """Unload each model that has had no job for its ``idle_unload`` seconds, its slots
        saved first (the ``CacheKeeper``); sleeps until the next one is due, or a model
        moves or is let go."""
        while True:
            now = time.monotonic()
            due = {h.name: h.idle_until() for h in self.hosts.values()}
            for name, at in due.items():
                if at is not None and at <= now:
                    host = self.hosts[name]
                    async with self._lock:
                        until = host.idle_until()  # a job may have come meanwhile
                        if until is not None and until <= time.monotonic():
                            await self._unload(host, f"no jobs for {host.idle_unload_s:g} s")
            pending = [at for at in due.values() if at is not None and at > now]
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(pending) - now if pending else None):
                    await changed.wait()

    async def _unload(self, host: HostedModel, why: str) -> None:
        """Unload ``host`` (evicted, idle, or as the router asked), its slots saved first."""
        log.info("model %s: %s; unloading (held %s)", host.name, why, host.footprint.describe())
        host.unloading = True
        try:
            if self.keeper is not None:
                await self.keeper.before_unload(host)
            await host.server.unload(why)
        finally:
            host.unloading = False
            self._change()

    def _free(self) -> None:
        self._freed.set()
        self._freed = asyncio.Event()
        self._change()

    def _change(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _moved(self, host: HostedModel, state: BackendState, detail: str) -> None:
        """A model's llama-server moved: its slots, its footprint, the worker's state."""
        if state is not BackendState.READY:
            host.slots.reset(f"llama-server {host.name} {state.value}")
        else:
            host.loaded()
        if state is BackendState.UNLOADED:
            self._free()
        else:
            self._change()
        overall = self.state
        if overall is not self._state:
            self._state = overall
            self._on_state(overall, f"model {host.name}: {detail}")
        self._on_models()

    def _cache(self) -> None:
        self._on_cache(self.summary())

    def control(self, model: str, action: str) -> bool:
        """The router's ``ModelControl`` for a text model: load (admit, evict, load) or
        unload (an eviction; not while a job holds it), carried out in ``run``'s task group.
        False: not one of these models."""
        host = self.hosts.get(model)
        if host is None or self._tg is None:
            return False
        self._tg.create_task(self._control(host, action))
        return True

    async def _control(self, host: HostedModel, action: str) -> None:
        model = host.name
        if action == "load":
            try:
                await self._ensure(host)
            except (ModelDoesNotFit, NotServing) as exc:
                log.warning("model %s: not loaded as asked: %s", model, exc)
            return
        if host.load is not None:  # unload what the load in flight brings
            with contextlib.suppress(ModelDoesNotFit, NotServing):
                await asyncio.shield(host.load)
        async with self._lock:
            if host.state is not BackendState.READY:
                log.info("model %s: not loaded; nothing to unload", model)
            elif host.holders or host.load is not None:
                log.info("model %s: not unloaded as asked: jobs hold it", model)
            else:
                await self._evict(host, "unloaded as the router asked")
