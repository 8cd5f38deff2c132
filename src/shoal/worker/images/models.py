"""A worker's image models: which one runs a job, and switching between them on request.

A worker may serve several image models (``--image-model a,b``) but keep only
``--image-max-loaded`` of them in memory. A job for a model that is not loaded makes room first:
the loaded model used longest ago is unloaded (once its running jobs end), then the asked one
loads, then the job runs. Switches are serialised, so two jobs never load two models into the
room of one. Every model keeps its own idle-unload timer (``ImageService``).

``ImageModels`` is the job runner's backend for the image endpoints; the worker's state, for a
worker without a text model, is the best of its models' (``combined_state``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shoal.protocol.ids import ModelName
from shoal.protocol.messages import BackendState, ErrorBody, JobFailed, JobStart, ModelInfo
from shoal.worker.images.backend import ImageBackend
from shoal.worker.images.engine import ImageEngine
from shoal.worker.images.service import ImageService
from shoal.worker.jobs.sink import JobSink

log = logging.getLogger(__name__)

StateCallback = Callable[[BackendState, str], None]
_IN_MEMORY = frozenset({BackendState.READY, BackendState.LOADING})
_STATE_ORDER = (
    BackendState.READY,
    BackendState.UNLOADED,
    BackendState.LOADING,
    BackendState.RESTARTING,
    BackendState.FAILED,
)


@dataclass(frozen=True)
class Resident:
    """A model in memory, as ``to_unload`` sees it."""

    name: str
    last_used: float


def to_unload(resident: Sequence[Resident], wanted: str, max_loaded: int) -> list[str]:
    """Which models to unload so ``wanted`` fits: the ones used longest ago (pure)."""
    others = sorted((r for r in resident if r.name != wanted), key=lambda r: (r.last_used, r.name))
    excess = len(others) - (max_loaded - 1)  # ``wanted`` needs one place, loaded or not
    return [r.name for r in others[: max(excess, 0)]]


def combined_state(states: Sequence[BackendState]) -> BackendState:
    """The worker's state from its models': ready if one is, else one that takes jobs."""
    for state in _STATE_ORDER:
        if state in states:
            return state
    return BackendState.LOADING


class ImageModels:
    def __init__(
        self,
        engines: Sequence[tuple[ModelName, ImageEngine]],
        *,
        on_models: Callable[[], None],
        on_state: StateCallback | None = None,
        max_loaded: int = 1,
        idle_unload_s: float = 0.0,
    ) -> None:
        """One ``ImageService`` and ``ImageBackend`` per engine; the first ``max_loaded``
        load at start, the rest on demand. ``on_models``: one model's state changed (the
        router lists each model's state); ``on_state``: the worker's state changed (None
        when a text model gives the worker its state)."""
        self.max_loaded = max_loaded
        self.on_state = on_state
        self.on_models = on_models
        self._switch = asyncio.Lock()
        self._reported: BackendState | None = None
        self._group: asyncio.TaskGroup | None = None
        self.services: dict[ModelName, ImageService] = {}
        self.backends: dict[ModelName, ImageBackend] = {}
        for n, (name, engine) in enumerate(engines):
            if n >= max_loaded:
                log.info("image model %s: starts unloaded (loads on its first job)", name)
            self.services[name] = ImageService(
                name,
                engine,
                on_state=self._changed,
                idle_unload_s=idle_unload_s,
                loaded_at_start=n < max_loaded,
            )
            self.backends[name] = ImageBackend(name, engine)

    @property
    def state(self) -> BackendState:
        return combined_state([s.state for s in self.services.values()])

    def infos(self) -> tuple[ModelInfo, ...]:
        return tuple(s.info() for s in self.services.values())

    def _changed(self, _state: BackendState, detail: str) -> None:
        self.on_models()
        state = self.state
        if state is not self._reported:
            self._reported = state
            if self.on_state is not None:
                self.on_state(state, detail)

    async def run(self) -> None:
        """Run every model's service until cancelled."""
        async with asyncio.TaskGroup() as tg:
            self._group = tg
            for service in self.services.values():
                tg.create_task(service.run())

    def control(self, model: ModelName, action: str) -> bool:
        """Load (making room, as a job would) or unload ``model`` now; False if unknown."""
        service = self.services.get(model)
        if service is None or self._group is None:
            return False
        log.info("image model %s: %s asked by the router", model, action)
        if action == "unload":
            service.unload()
        else:
            self._group.create_task(self._load(service))
        return True

    async def _load(self, service: ImageService) -> None:
        async with self._switch:
            await self._make_room(service.name)
            service.load()

    async def run_job(self, job: JobStart, out: JobSink) -> None:
        """The runner's backend call for an image job: switch to its model, then run it."""
        service = self.services.get(job.model)
        if service is None:
            error = ErrorBody(
                message=f"This worker does not serve the image model {job.model!r}.",
                type="invalid_request_error",
                code="model_not_found",
            )
            out.send(JobFailed(job_id=job.job_id, status=404, error=error))
            return
        async with contextlib.AsyncExitStack() as stack:
            async with self._switch:
                await self._make_room(service.name)
                await stack.enter_async_context(service.use())
            await self.backends[service.name].run(job, out)

    async def _make_room(self, wanted: ModelName) -> None:
        resident = [
            Resident(s.name, s.last_used) for s in self.services.values() if s.state in _IN_MEMORY
        ]
        for name in to_unload(resident, wanted, self.max_loaded):
            victim = self.services[ModelName(name)]
            log.info("image model %s: unloading to make room for %s", name, wanted)
            victim.unload()
            await victim.wait_for(BackendState.UNLOADED, BackendState.FAILED)
