"""Connected workers as the router sees them, each with its connection state machine.

OPEN ──Register ok──▶ ACTIVE ──socket closed / heartbeat missed / bad frame──▶ CLOSED
  └──refused─────────────────────────────────────────────────────────────────▶ CLOSED

``ALLOWED`` is that diagram as a table (``shoal.lifecycle``); any other move raises
``IllegalTransition``.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from functools import cached_property

from shoal.lifecycle import Transitions
from shoal.protocol.ids import JobId, ModelName, WorkerId
from shoal.protocol.messages import (
    BackendState,
    Endpoint,
    Hardware,
    Heartbeat,
    HeartbeatInterval,
    Message,
    ModelInfo,
    Register,
    ShardDevice,
    encode,
)
from shoal.protocol.telemetry import GpuSample
from shoal.router.dispatch.job import Job
from shoal.router.dispatch.model_views import ModelView, ModelViews
from shoal.router.dispatch.outbox import Outbox
from shoal.router.dispatch.scheduler import ModelLoad, WorkerLoad, contexts_of

log = logging.getLogger(__name__)


class ConnState(enum.StrEnum):
    OPEN = "open"
    ACTIVE = "active"
    CLOSED = "closed"


ALLOWED = Transitions(
    {
        ConnState.OPEN: {ConnState.ACTIVE, ConnState.CLOSED},
        ConnState.ACTIVE: {ConnState.CLOSED},
        ConnState.CLOSED: set(),
    }
)


_TAKES_JOBS = frozenset({BackendState.READY, BackendState.UNLOADED})
_LOADED_BY_A_JOB = frozenset({BackendState.UNLOADED, BackendState.FAILED})


@dataclass(eq=False)
class WorkerConnection:
    id: WorkerId
    name: str
    hardware: Hardware
    models: tuple[ModelInfo, ...]
    slots: int
    backend_state: BackendState
    backend_url: str | None = None
    software: str = ""
    detail: str = ""
    peer: str = ""
    conn_state: ConnState = ConnState.OPEN
    running: dict[JobId, Job] = field(default_factory=dict)
    last_assigned: float = 0.0
    last_seen: float = field(default_factory=time.monotonic)
    held_since: float = 0.0
    """When the latest job was placed on it: the stall clock starts there, not at a heartbeat
    an idle worker sent up to its (long) idle interval ago."""
    heartbeat_interval: float = 5.0
    """How often it beats while idle (what it was told: ``Registered``, ``HeartbeatInterval``)."""
    miss_interval: float = 5.0
    """The interval its miss timeout counts in: its own, or, just after it was told a shorter
    one, the longer one until its next heartbeat (the shorter reaches it in flight)."""
    connected_at: float = field(default_factory=time.time)
    ram_available_bytes: int = 0
    gpu_free_bytes: tuple[int | None, ...] = ()
    gpu_telemetry: tuple[GpuSample, ...] = ()
    """Each GPU's utilization, memory, temperature and power, as of its last heartbeat."""
    stage_memory_bytes: int | None = None
    """What a split model's stage may hold here (``Register.stage_memory_bytes``)."""
    shard_devices: tuple[ShardDevice, ...] = ()
    """The GPUs split models may use here, with their free memory (``Register``)."""
    no_shards: str | None = None
    """Why it cannot run parts of split models (None: it can)."""
    shard_ram_bytes: int | None = None
    """The most RAM split models may plan on here (``Register.shard_ram_bytes``)."""
    gpus_unused: str | None = None
    """Why its GPUs sit idle (``Register.gpus_unused``; None: they do not)."""
    model_budget_bytes: int | None = None
    """What its resident text models may hold together (``Register.model_budget_bytes``)."""
    assigned: dict[ModelName, float] = field(default_factory=dict)
    """Each model's last job placed here by this router (monotonic): ``ModelLoad``."""
    draining: bool = False
    """It is stopping (``Draining``): it takes no new job and finishes those it runs."""
    cached: frozenset[int] = frozenset()
    """The prefix hashes its llama-server's slots hold (``CacheChanged``), with those of the
    jobs placed on it since (its report may not include them yet)."""
    outbox: Outbox = field(default_factory=Outbox)
    on_hold: Callable[[], None] | None = None
    """Told when a job is placed on it: its watchdog (``routes/watchdog.py``) watches for a
    stall from then."""
    served: frozenset[tuple[ModelName, Endpoint]] = frozenset()
    contexts: tuple[tuple[ModelName, int], ...] = ()
    """Each model's context per slot, where known (``scheduler.contexts_of``)."""
    _models_json: list[dict[str, object]] | None = None
    """``models`` as JSON, kept from the first ``summary`` after they change (with Redis the
    directory asks for it every sync)."""
    watcher: Callable[[WorkerConnection], None] | None = None
    """Told when its models, backend state or connection change: the ``Registry`` holding
    it, which keeps its per-model views (``model_views``) up to date."""

    @classmethod
    def from_register(cls, msg: Register, peer: str, interval: float = 5.0) -> WorkerConnection:
        """``interval``: the heartbeat interval it is told in ``Registered`` (the base)."""
        conn = cls(
            id=msg.worker_id,
            name=msg.name,
            hardware=msg.hardware,
            models=msg.models,
            slots=msg.slots,
            backend_state=msg.state,
            backend_url=msg.backend_url,
            software=msg.software,
            peer=peer,
            ram_available_bytes=msg.hardware.ram_available_bytes,
            gpu_free_bytes=tuple(g.memory_free_bytes for g in msg.hardware.gpus),
            stage_memory_bytes=msg.stage_memory_bytes,
            shard_devices=msg.shard_devices,
            no_shards=msg.no_shards,
            shard_ram_bytes=msg.shard_ram_bytes,
            gpus_unused=msg.gpus_unused,
            model_budget_bytes=msg.model_budget_bytes,
            heartbeat_interval=interval,
            miss_interval=interval,
        )
        if msg.gpus_unused:
            log.warning("worker %s (%s): %s", msg.worker_id, msg.name, msg.gpus_unused)
        conn.set_models(msg.models)
        return conn

    def on_heartbeat(self, msg: Heartbeat) -> None:
        """The memory figures and GPU telemetry a heartbeat refreshes (the caller handles its
        state)."""
        self.ram_available_bytes = msg.ram_available_bytes
        self.gpu_free_bytes = msg.gpu_free_bytes
        self.gpu_telemetry = msg.gpu_telemetry
        self.stage_memory_bytes = msg.stage_memory_bytes
        self.shard_devices = msg.shard_devices
        self.set_cached(msg.cached_blocks)
        self.miss_interval = self.heartbeat_interval  # a shorter interval reached it

    def pace(self, interval: float) -> None:
        """Tell it to beat every ``interval`` while idle (``dispatch/heartbeats.py``)."""
        if interval == self.heartbeat_interval:
            return
        self.miss_interval = max(self.miss_interval, interval)
        self.heartbeat_interval = interval
        self.send(HeartbeatInterval(seconds=interval))

    def set_cached(self, blocks: tuple[int, ...]) -> None:
        """What the worker reports its slots hold, plus the prefixes of its running jobs."""
        self.cached = frozenset(blocks).union(*(job.prefix for job in self.running.values()))

    def hold(self, run: JobId, job: Job) -> None:
        """``job`` runs here (as ``run``, its wire id): it holds a slot until it ends."""
        self.running[run] = job
        self.held_since = time.monotonic()
        if self.on_hold is not None:
            self.on_hold()

    def note_prefix(self, prefix: tuple[int, ...]) -> None:
        """A job with ``prefix`` was placed here: its slot will hold it."""
        if prefix:
            self.cached = self.cached.union(prefix)

    def set_models(self, models: tuple[ModelInfo, ...]) -> None:
        if models != self.models:
            log.info(
                "worker %s (%s): models %s",
                self.id,
                self.name,
                ", ".join(m.name for m in models) or "none yet",
            )
        self.models = models
        self.served = frozenset((m.name, e) for m in models for e in m.endpoints)
        self.contexts = contexts_of(models)
        self._models_json = None
        self._changed()

    def _changed(self) -> None:
        if self.watcher is not None:
            self.watcher(self)

    def move(self, new: ConnState, why: str) -> None:
        who = f"worker {self.id} ({self.name}) connection"
        self.conn_state = ALLOWED.move(who, self.conn_state, new, why, log)
        self._changed()

    def set_backend_state(self, state: BackendState, detail: str, backend_url: str | None) -> None:
        """``backend_url``: where the backend serves now (a restarted llama-server listens on
        a new port)."""
        if state is not self.backend_state:
            log.info(
                "worker %s (%s): backend %s -> %s %s",
                self.id,
                self.name,
                self.backend_state,
                state,
                detail,
            )
        changed = state is not self.backend_state
        self.backend_state = state
        self.detail = detail
        self.backend_url = backend_url
        if changed:
            self._changed()

    def drain(self, timeout_s: float) -> None:
        """It stops once its jobs are done (at most ``timeout_s``): no new job goes to it."""
        if not self.draining:
            log.info(
                "worker %s (%s): draining, %d job(s) running, closing in at most %g s",
                self.id,
                self.name,
                len(self.running),
                timeout_s,
            )
            self.draining = True
            self._changed()

    def send(self, message: Message) -> None:
        """Queue a frame for this worker's writer; never blocks."""
        self.outbox.put_nowait(encode(message))

    @property
    def ready(self) -> bool:
        """Connected, its backend ready, and not draining."""
        return (
            self.conn_state is ConnState.ACTIVE
            and self.backend_state is BackendState.READY
            and not self.draining
        )

    @property
    def available(self) -> bool:
        """Takes jobs: ready, or unloaded after idling (the job waits while it loads again);
        never while draining."""
        return (
            self.conn_state is ConnState.ACTIVE
            and self.backend_state in _TAKES_JOBS
            and not self.draining
        )

    def running_of(self, model: ModelName) -> int:
        """The jobs of ``model`` running here."""
        return sum(1 for job in self.running.values() if job.model == model)

    def residency(self) -> tuple[ModelLoad, ...]:
        """Its models that report a state of their own, with their jobs here. One that is not
        loaded but has a job here is taken as loading (that job loads it) until the worker
        says otherwise: no other job is placed to evict it, nor counts on its memory."""
        out = []
        for m in self.models:
            if m.state is None:
                continue
            running = self.running_of(m.name)
            state = m.state
            if running and state in _LOADED_BY_A_JOB:
                state = BackendState.LOADING
            out.append(
                ModelLoad(
                    m.name,
                    state,
                    m.slots,
                    running,
                    m.resident_bytes,
                    m.pinned,
                    self.assigned.get(m.name, 0.0),
                )
            )
        return tuple(out)

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            id=self.id,
            ready=self.available,
            loaded=self.ready,
            models=self.served,
            slots=self.slots,
            running=len(self.running),
            last_assigned=self.last_assigned,
            cached=self.cached,
            contexts=self.contexts,
            residency=self.residency(),
            budget=self.model_budget_bytes,
        )

    def models_json(self) -> list[dict[str, object]]:
        if self._models_json is None:
            self._models_json = [m.model_dump(mode="json") for m in self.models]
        return self._models_json

    @cached_property
    def hardware_json(self) -> dict[str, object]:
        """``hardware`` as JSON (it is what the worker registered with: it never changes)."""
        return self.hardware.model_dump(mode="json")

    def summary(self) -> dict[str, object]:
        return {
            "id": self.id,
            "name": self.name,
            "state": self.backend_state.value,
            "detail": self.detail,
            "connection": self.conn_state.value,
            "draining": self.draining,
            "models": self.models_json(),
            "slots": self.slots,
            "running_jobs": len(self.running),
            "hardware": self.hardware_json,
            "ram_available_bytes": self.ram_available_bytes,
            "gpu_free_bytes": list(self.gpu_free_bytes),
            "gpu_telemetry": [g.model_dump(mode="json") for g in self.gpu_telemetry],
            "stage_memory_bytes": self.stage_memory_bytes,
            "gpus_unused": self.gpus_unused,
            "model_budget_bytes": self.model_budget_bytes,
            "running_by_model": self._running_by_model(),
            "shard_devices": [d.model_dump(mode="json") for d in self.shard_devices],
            "backend_url": self.backend_url,
            "software": self.software,
            "peer": self.peer,
            "connected_at": self.connected_at,
            "last_seen_s_ago": round(time.monotonic() - self.last_seen, 3),
            "cached_blocks": sorted(self.cached),
        }

    def _running_by_model(self) -> dict[str, int]:
        """The jobs running here per model, for models with a state of their own (with Redis
        the other routers rank this worker by them: ``RemoteWorker.load``)."""
        return {m.name: self.running_of(m.name) for m in self.models if m.state is not None}


class Registry:
    """Active workers by id, and what they add up to per model (``model_views``)."""

    def __init__(self) -> None:
        self._workers: dict[WorkerId, WorkerConnection] = {}
        self._views: ModelViews[WorkerConnection] = ModelViews()
        self._listeners: list[Callable[[WorkerConnection], None]] = []

    def listen(self, listener: Callable[[WorkerConnection], None]) -> None:
        """Tell ``listener`` when a worker's models, backend state or connection change
        (after its model views are updated)."""
        self._listeners.append(listener)

    def add(self, conn: WorkerConnection) -> None:
        old = self._workers.get(conn.id)
        if old is not None and old is not conn:
            self.remove(old)
        self._workers[conn.id] = conn
        conn.watcher = self._changed
        self._views.put(conn)

    def _changed(self, conn: WorkerConnection) -> None:
        self._views.put(conn)
        for listener in self._listeners:
            listener(conn)

    def remove(self, conn: WorkerConnection) -> None:
        if self._workers.get(conn.id) is conn:
            del self._workers[conn.id]
            conn.watcher = None
            self._views.drop(conn)

    def get(self, worker_id: WorkerId) -> WorkerConnection | None:
        return self._workers.get(worker_id)

    def __iter__(self) -> Iterator[WorkerConnection]:
        """Every worker (a copy of the list: walking it is O(workers), for on-demand views)."""
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def names(self) -> dict[WorkerId, str]:
        """Each connected worker's id -> the name it was started with (``--name``)."""
        return {i: w.name for i, w in self._workers.items()}

    def model_names(self) -> Collection[ModelName]:
        """The models some worker here serves."""
        return self._views.models()

    def view(self, model: ModelName) -> ModelView[WorkerConnection] | None:
        """What the workers serving ``model`` add up to; None if none does."""
        return self._views.view(model)

    def serving(self, model: ModelName, endpoint: Endpoint) -> Collection[WorkerConnection]:
        """The workers serving ``model`` for ``endpoint``, without walking the others (not
        to be iterated while workers join, leave or change)."""
        return self._views.serving(model, endpoint)

    def ready(self) -> int:
        """How many workers are ready (connected, backend ready)."""
        return self._views.ready()

    def model_info(self, name: ModelName) -> list[tuple[WorkerConnection, ModelInfo]]:
        """Each worker serving ``name``, with its entry for it."""
        view = self._views.view(name)
        if view is None:
            return []
        workers = (self._workers[i] for i in view.workers)
        return [(w, m) for w in workers for m in w.models if m.name == name]
