"""What the worker serves, and every link told of its changes: its text model (none until a
deferred one is resolved), or its several text models (``text/residency/``), its image
models and its parts in split models.

``Serving`` starts the text backend once its plan is known (at start, or from the router's
``registered`` reply: ``adopt_default``) and gives the job runner its ``Backend``; with
several text models, it starts their ``TextModels`` and routes each model's jobs to it. It
answers the router's model controls and passes its orders about split models on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import aiohttp

from shoal.hardware.profile import MachineProfile
from shoal.models.default import DEFAULT_MODEL
from shoal.models.residency import Footprint
from shoal.protocol.messages import (
    BackendState,
    JobLoading,
    Message,
    ModelControl,
    ModelInfo,
)
from shoal.worker.images.plan import ImagePlan, start_images
from shoal.worker.jobs.runner import JobRunner
from shoal.worker.link.router_link import NoShards, RouterLink, ShardOrders
from shoal.worker.settings import WorkerSettings
from shoal.worker.shards.host import ShardHost
from shoal.worker.shards.tools import NO_LLAMA_CPP
from shoal.worker.text.attached import AttachedServer
from shoal.worker.text.backend import Backend, BackendTarget, discover_model
from shoal.worker.text.llama_server import LlamaServer
from shoal.worker.text.pinning import SlotPinning
from shoal.worker.text.plan import Plan, plan
from shoal.worker.text.residency.keeper import KeptCaches
from shoal.worker.text.residency.models import TextModels
from shoal.worker.text.residency.planned import PlannedModel, budget_of, slot_saves
from shoal.worker.text.slots import SlotTable

TextPlan = Plan | tuple[PlannedModel, ...]
"""One text model's plan, or several models' (``text/residency/planned.py``)."""

log = logging.getLogger(__name__)


class Link(Protocol):
    """How jobs reach this worker: a router (``RouterLink``) or Redis (``RedisPuller``)."""

    def on_models(self, models: tuple[ModelInfo, ...]) -> None: ...

    def on_backend_state(self, state: BackendState, detail: str) -> None: ...

    def on_cache(self, blocks: tuple[int, ...]) -> None: ...


ShardFactory = Callable[[Callable[[], None]], ShardHost]
"""Builds this worker's ``ShardHost``, given what to call when the split models it heads
change."""


class Serving:
    """What the worker serves: its text model (none until a deferred one is resolved), its
    image models and its parts in split models. Every link hears of changes."""

    def __init__(
        self,
        settings: WorkerSettings,
        machine: MachineProfile,
        path_env: str | None,
        on_ready: Callable[[], None] | None,
        *,
        shards: ShardFactory | str,
        image_plans: Sequence[ImagePlan] = (),
        images_give_state: bool = False,
        gpus_unused: str | None = None,
    ) -> None:
        """``shards``: how to build the shard host, or why this worker cannot run parts of
        split models. ``images_give_state``: the image models' state is the worker's (it
        serves no text). ``gpus_unused``: why the GPUs would sit idle, known before a plan."""
        self.text_models: TextModels | None = None
        """Several text models (None: one, or none)."""
        self.model_budget: Footprint | None = None
        """The memory the several text models may hold together."""
        self.early_gpus_unused = gpus_unused
        self.settings = settings
        self.machine = machine
        self.path_env = path_env
        self.on_ready = on_ready
        self.plan: Plan | None = None
        self.supervisor: LlamaServer | AttachedServer | None = None
        self.slots: SlotTable | None = None
        """What our llama-server's slots hold (None: no llama-server of ours yet)."""
        self.pinning: SlotPinning | None = None
        self.links: list[Link] = []
        """Told of every change; a link is added once built (it reads ``models``)."""
        self.images = (
            start_images(
                list(image_plans),
                settings,
                on_models=self.models_changed,
                on_state=self.on_state if images_give_state else None,
            )
            if image_plans
            else None
        )
        self.shards = None if isinstance(shards, str) else shards(self.models_changed)
        """Its parts in split models (heads serve theirs as models of this worker)."""
        self.no_shards = shards if isinstance(shards, str) else None
        """Why it cannot run parts of split models (None when ``shards`` is up)."""

    @property
    def state(self) -> BackendState:
        if self.text_models is not None:
            return self.text_models.state
        if self.supervisor is None and self.images is not None:
            return self.images.state  # a worker with only image models
        return self.supervisor.state if self.supervisor else BackendState.LOADING

    @property
    def backend_url(self) -> str | None:
        """Where the backend serves now (None: none of ours, or not started)."""
        return (self.supervisor.url or None) if self.supervisor else None

    @property
    def text_slots(self) -> int | None:
        """Text jobs served at once: every text model's slots (None: not planned yet)."""
        if self.text_models is not None:
            return self.text_models.slots
        return self.settings.slots if self.plan else None

    @property
    def models(self) -> tuple[ModelInfo, ...]:
        text: tuple[ModelInfo, ...] = (self.plan.model,) if self.plan else ()
        if self.text_models is not None:
            text = self.text_models.infos()
        split = self.shards.models if self.shards else ()
        return text + split + (self.images.infos() if self.images else ())

    def models_changed(self) -> None:
        for link in self.links:
            link.on_models(self.models)

    def on_state(self, state: BackendState, detail: str) -> None:
        if state is not BackendState.READY and self.slots is not None:
            self.slots.reset(f"llama-server {state.value}")  # a new process holds nothing
        for link in self.links:
            link.on_backend_state(state, detail)
        if state is BackendState.READY and self.pinning is not None:
            self.pinning.ready()  # a new llama-server: measure its prompt speed
        if state is BackendState.READY and self.on_ready is not None:
            self.on_ready()

    def cache_changed(self, blocks: tuple[int, ...]) -> None:
        for link in self.links:
            link.on_cache(blocks)

    def control_model(self, msg: ModelControl) -> bool:
        """Load or unload an image model, or one of several text models, as the router asks;
        False if none is served here (these load and unload apart: the router lists each
        one's state)."""
        if self.text_models is not None and self.text_models.control(msg.model, msg.action):
            return True
        return self.images is not None and self.images.control(msg.model, msg.action)

    def shard_orders(self, send: Callable[[Message], None]) -> ShardOrders:
        """Where the router's orders about split models go."""
        if self.shards is not None:
            return self.shards
        return NoShards(self.no_shards or NO_LLAMA_CPP, send)

    async def start(
        self,
        the_plan: TextPlan,
        tg: asyncio.TaskGroup,
        runner: JobRunner,
        session: aiohttp.ClientSession,
        loading: Callable[[JobLoading], None] | None = None,
    ) -> None:
        """``session`` carries the jobs (``loopback``). ``loading``: where a job that waits
        for one of several text models to load is told of (the router link's outbox, or the
        Redis puller)."""
        if isinstance(the_plan, tuple):
            self.start_several(the_plan, tg, runner, session, loading)
            return
        supervisor: LlamaServer | AttachedServer
        pinning: SlotPinning | None = None
        if the_plan.llama is not None:
            supervisor = LlamaServer(the_plan.llama, self.on_state)
            self.slots = SlotTable(the_plan.llama.slots, self.cache_changed)
            pinning = self.pinning = SlotPinning(self.slots, session, lambda: supervisor.url)
            tg.create_task(pinning.run_measure())
        else:
            assert self.settings.backend_url is not None
            supervisor = AttachedServer(self.settings.backend_url.rstrip("/"), self.on_state)
        self.plan, self.supervisor = the_plan, supervisor
        self.models_changed()
        tg.create_task(supervisor.run())
        target = await backend_target(self.settings, the_plan, supervisor, session)
        backend = Backend(target, session, lambda: supervisor.url, pinning)
        tg.create_task(runner.run(backend.run, supervisor.use))

    def start_several(
        self,
        planned: tuple[PlannedModel, ...],
        tg: asyncio.TaskGroup,
        runner: JobRunner,
        session: aiohttp.ClientSession,
        loading: Callable[[JobLoading], None] | None,
    ) -> None:
        """Several text models: each model's jobs go to it through ``TextModels``."""
        self.model_budget = budget_of(self.settings, self.machine)
        models = self.text_models = TextModels(
            planned,
            session,
            self.model_budget,
            on_models=self.models_changed,
            on_state=self.on_state,
            on_cache=self.cache_changed,
            loading=loading,
            keeper=KeptCaches(slot_saves(self.settings), session),
        )
        self.plan = planned[0].plan
        log.info(
            "serving %d text models (%s) in a budget of %s",
            len(planned),
            ", ".join(models.hosts),
            self.model_budget.describe(),
        )
        self.models_changed()
        tg.create_task(models.run())
        for name in models.hosts:
            runner.route(name, models.job_function(name), contextlib.nullcontext)
        tg.create_task(runner.run(models.job_function(planned[0].plan.model.name)))

    async def adopt_default(
        self,
        link: RouterLink,
        tg: asyncio.TaskGroup,
        runner: JobRunner,
        session: aiohttp.ClientSession,
    ) -> None:
        """Serve the model the router names in its first ``registered`` reply."""
        model = await link.default_model or DEFAULT_MODEL.id
        log.info("no --model given: serving the router's default model %s", model)
        the_plan = await asyncio.to_thread(plan, self.settings, self.path_env, self.machine, model)
        await self.start(the_plan, tg, runner, session)


async def backend_target(
    settings: WorkerSettings,
    the_plan: Plan,
    supervisor: LlamaServer | AttachedServer,
    session: aiohttp.ClientSession,
) -> BackendTarget:
    """How jobs are sent to the text backend: our llama-server, or an attached server (whose
    model is asked at ``/v1/models`` unless ``--backend-model`` names it)."""
    api_key = settings.backend_api_key.get_secret_value() if settings.backend_api_key else None
    if isinstance(supervisor, LlamaServer):
        return BackendTarget(
            the_plan.model.name, stream_upstream=True, token_ids=True, spare_path="/health"
        )
    backend_model = settings.backend_model
    if backend_model is None:
        await supervisor.ready.wait()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        backend_model = await discover_model(session, supervisor.url, headers)
        log.info("attached backend %s serves %r", supervisor.url, backend_model)
    rename = backend_model if backend_model != the_plan.model.name else None
    return BackendTarget(
        the_plan.model.name, rename, api_key, ask_usage=True, spare_path="/v1/models"
    )
