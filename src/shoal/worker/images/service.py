"""An image model on this worker: its engine, its state machine, and the idle-unload rule.

    LOADING ──loaded──▶ READY ──idle_unload_s without jobs, or unload()──▶ UNLOADED
       │  ▲                                                                  │
       │  └───────────────a job arrives (it waits), or load()────────────────┘
       └──load failed──▶ FAILED ──load() (retry)──▶ LOADING

``ALLOWED`` is that diagram as a table (``shoal.lifecycle``); any other move raises
``IllegalTransition``. A model past ``--image-max-loaded`` starts UNLOADED
(``loaded_at_start=False``). ``use`` is the gate of its jobs, like ``LlamaServer.use`` for
text (both wait in ``BackendLifecycle.until_ready``): it loads the model when it is unloaded
and holds it while the job runs. Nothing polls: ``run`` waits on events and on the idle
deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from shoal.lifecycle import Transitions
from shoal.protocol.ids import ModelName
from shoal.protocol.messages import BackendState, Endpoint, ModelInfo
from shoal.worker.images.engine import ImageEngine, ImageEngineError
from shoal.worker.lifecycle import BackendLifecycle, NotServing, StateCallback

log = logging.getLogger(__name__)

IMAGE_MODEL_ENDPOINTS = (Endpoint.IMAGE_GENERATIONS, Endpoint.IMAGE_EDITS)

ALLOWED = Transitions(
    {
        BackendState.LOADING: frozenset({BackendState.READY, BackendState.FAILED}),
        BackendState.READY: frozenset({BackendState.UNLOADED}),
        BackendState.UNLOADED: frozenset({BackendState.LOADING}),
        BackendState.FAILED: frozenset({BackendState.LOADING}),
        BackendState.RESTARTING: frozenset(),  # never an image model's state
    }
)


class ImageNotServing(NotServing):
    """A job waited for the image model, which failed to load."""


class ImageService:
    def __init__(
        self,
        name: ModelName,
        engine: ImageEngine,
        *,
        on_state: StateCallback,
        idle_unload_s: float = 0.0,
        loaded_at_start: bool = True,
    ) -> None:
        """``loaded_at_start=False``: the model starts UNLOADED; its first job (or ``load()``)
        loads it."""
        self.name = name
        self.engine = engine
        self.idle_unload_s = idle_unload_s
        start = BackendState.LOADING if loaded_at_start else BackendState.UNLOADED
        self._life = BackendLifecycle(f"image model {name}", ALLOWED, start, on_state, log)
        """Its ``wanted`` is set when a job (or ``load()``) needs the model while it is
        unloaded or failed."""
        self._active = 0
        self._last_job_at = time.monotonic()
        self._poke = asyncio.Event()
        """A job ended, or ``unload()`` was asked: the idle deadline is looked at again."""
        self._unload_asked = False

    def info(self) -> ModelInfo:
        return ModelInfo(
            name=self.name,
            endpoints=IMAGE_MODEL_ENDPOINTS,
            backend=self.engine.backend,
            state=self.state,
        )

    @property
    def state(self) -> BackendState:
        return self._life.state

    @property
    def detail(self) -> str:
        return self._life.detail

    # ------------------------------------------------------------ requests

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[None]:
        """Hold the model for one job: load it first if needed; raises ``ImageNotServing``
        when loading fails while the job waits."""
        self._active += 1
        try:
            await self._life.until_ready(ImageNotServing)
            yield
        finally:
            self._active -= 1
            self._last_job_at = time.monotonic()
            self._poke.set()

    @property
    def last_used(self) -> float:
        """Monotonic time a job last held the model (now, while one does)."""
        return time.monotonic() if self._active else self._last_job_at

    async def wait_for(self, *states: BackendState) -> None:
        while self.state not in states:
            await self._life.changed.wait()

    def load(self) -> None:
        """Load the model now (or retry a failed load); ``run`` does it."""
        self._unload_asked = False
        self._life.wanted.set()

    def unload(self) -> None:
        """Unload the model once no job holds it; the next job loads it again."""
        self._unload_asked = True
        self._poke.set()

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Load, serve, unload when idle (or asked), load again on demand; until cancelled."""
        try:
            while True:
                if self.state is BackendState.LOADING:
                    await self._load()
                if self.state is BackendState.READY:
                    why = await self._until_unload()
                    await self.engine.unload()
                    self._life.move(BackendState.UNLOADED, why)
                await self._life.load_when_wanted("a job arrived, or a load was asked")
        finally:
            with contextlib.suppress(ImageEngineError):
                await self.engine.unload()

    async def _load(self) -> None:
        started = time.monotonic()
        try:
            await self.engine.load()
        except ImageEngineError as exc:
            self._life.move(BackendState.FAILED, str(exc))
            return
        self._unload_asked = False
        self._last_job_at = time.monotonic()  # idle time counts from now, not from the request
        self._life.move(BackendState.READY, f"loaded in {time.monotonic() - started:.1f} s")

    def _idle_left(self) -> float | None:
        if self._active:
            return None
        if self._unload_asked:
            return 0.0
        if not self.idle_unload_s:
            return None
        return self._last_job_at + self.idle_unload_s - time.monotonic()

    async def _until_unload(self) -> str:
        """Wait until the model should be unloaded; why."""
        while True:
            self._poke.clear()
            left = self._idle_left()
            if left is not None and left <= 0:
                if self._unload_asked:
                    return "unload asked"
                return f"no jobs for {self.idle_unload_s:g} s; memory freed"
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._poke.wait()
