"""The worker's composition root: resolve what to run (``plan.py``), then run it all in one
task group.

A worker started with ``--model`` (or ``--model-path``) resolves its model before it dials the
router, so mistakes fail fast. One started without learns the router's default model from the
``registered`` reply, resolves it then, and tells the router with a ``models`` message.

With ``--redis-url`` (pull mode) no router is dialed: a ``RedisPuller`` takes jobs straight
from the Redis job queue, and a worker started without a model serves Shoal's default model.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import aiohttp

from shoal import __version__
from shoal.hardware.profile import MachineProfile
from shoal.llama_cpp.devices import ComputeDevice, list_devices, stage_devices
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.options import binaries as llama_cpp_binaries
from shoal.llama_cpp.rpc_cache import RpcCache
from shoal.llama_cpp.threads import spin_env, stage_threads
from shoal.llama_cpp.version import server_version
from shoal.models.default import DEFAULT_MODEL
from shoal.paths import logs_dir, rpc_cache_dir
from shoal.protocol.ids import WorkerId, new_worker_id
from shoal.protocol.messages import (
    IMAGE_ENDPOINTS,
    PROTOCOL_VERSION,
    BackendState,
    Message,
    ModelControl,
    ModelInfo,
    Register,
    ShardStart,
)
from shoal.units import GIB
from shoal.worker import hardware
from shoal.worker.images.plan import ImagePlan, plan_images, start_images
from shoal.worker.jobs.runner import JobRunner
from shoal.worker.link.drain import Drain, Drained, drain
from shoal.worker.link.outbox import Outbox
from shoal.worker.link.redis_pull import RedisPuller, redis_address, redis_client
from shoal.worker.link.router_link import (
    NO_LLAMA_CPP,
    NoShards,
    RouterLink,
    Routers,
    ShardOrders,
    client_tls_context,
)
from shoal.worker.settings import WorkerSettings
from shoal.worker.shards.host import ShardHost, ShardTools
from shoal.worker.shards.tunnels import TunnelEnds
from shoal.worker.text import loopback
from shoal.worker.text.attached import AttachedServer
from shoal.worker.text.backend import Backend, BackendTarget, discover_model
from shoal.worker.text.llama_server import LlamaServer
from shoal.worker.text.pinning import SlotPinning
from shoal.worker.text.plan import (
    Plan,
    gpus_unused_before_plan,
    local_model,
    needs_router_default,
    pinned_model,
    plan,
    stage_source,
)
from shoal.worker.text.slots import SlotTable

log = logging.getLogger(__name__)


class Link(Protocol):
    """How jobs reach this worker: a router (``RouterLink``) or Redis (``RedisPuller``)."""

    def on_models(self, models: tuple[ModelInfo, ...]) -> None: ...

    def on_backend_state(self, state: BackendState, detail: str) -> None: ...

    def on_cache(self, blocks: tuple[int, ...]) -> None: ...


ShardFactory = Callable[[Callable[[], None]], ShardHost]
"""Builds this worker's ``ShardHost``, given what to call when the split models it heads
change."""

PULL_NO_SHARDS = "a pull-mode worker (--redis-url) takes no part in split models"


class _Serving:
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
        if self.supervisor is None and self.images is not None:
            return self.images.state  # a worker with only image models
        return self.supervisor.state if self.supervisor else BackendState.LOADING

    @property
    def backend_url(self) -> str | None:
        """Where the backend serves now (None: none of ours, or not started)."""
        return (self.supervisor.url or None) if self.supervisor else None

    @property
    def models(self) -> tuple[ModelInfo, ...]:
        text = (self.plan.model,) if self.plan else ()
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
        """Load or unload an image model as the router asks; False if none is served here
        (image models load and unload apart: the router lists each one's state)."""
        return self.images is not None and self.images.control(msg.model, msg.action)

    def shard_orders(self, send: Callable[[Message], None]) -> ShardOrders:
        """Where the router's orders about split models go."""
        if self.shards is not None:
            return self.shards
        return NoShards(self.no_shards or NO_LLAMA_CPP, send)

    async def start(
        self,
        the_plan: Plan,
        tg: asyncio.TaskGroup,
        runner: JobRunner,
        session: aiohttp.ClientSession,
    ) -> None:
        """``session`` carries the jobs (``loopback``)."""
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
        target = await _target(self.settings, the_plan, supervisor, session)
        backend = Backend(target, session, lambda: supervisor.url, pinning)
        tg.create_task(runner.run(backend, supervisor.use))

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


def _registration(
    worker_id: WorkerId,
    settings: WorkerSettings,
    machine: MachineProfile,
    serving: _Serving,
    memory: hardware.MemoryProbe,
) -> Callable[[], Register]:
    """What the worker tells a router (or the Redis worker list) about itself, now."""

    def register() -> Register:
        return Register(
            protocol_version=PROTOCOL_VERSION,
            worker_id=worker_id,
            name=settings.name,
            hardware=hardware.to_wire(machine),
            models=serving.models,
            slots=settings.slots if serving.plan or not serving.images else settings.image_slots,
            state=serving.state,
            backend_url=serving.backend_url,
            software=f"shoal {__version__}",
            stage_memory_bytes=memory.stage_memory(),
            shard_devices=memory.shard_devices(),
            no_shards=serving.no_shards,
            gpus_unused=serving.plan.gpus_unused if serving.plan else serving.early_gpus_unused,
        )

    return register


def _routers(settings: WorkerSettings) -> Routers:
    """The routers to dial, saying which host:port ones are dialed over wss:// (--tls-ca)."""
    if settings.inferred_wss:
        log.info(
            "dialing %s over wss://: --tls-ca is given and the URL names no scheme",
            ", ".join(settings.inferred_wss),
        )
    gpu_key = settings.gpu_key.get_secret_value() if settings.gpu_key else None
    return Routers(settings.ws_urls, gpu_key, client_tls_context(settings.tls_ca))


async def run_worker(
    settings: WorkerSettings,
    the_plan: Plan | None,
    on_ready: Callable[[], None] | None = None,
    *,
    path_env: str | None = None,
    machine: MachineProfile | None = None,
    stop: Drain | None = None,
) -> None:
    """Run until cancelled, or until ``stop`` is requested and the drain ends (``drain.py``).
    Raises ``link.Refusal`` when the router will never accept us.

    With ``the_plan`` None the model is the router's default, resolved after registering
    (in pull mode, Shoal's default model, resolved first).
    """
    stop = stop or Drain()
    worker_id = new_worker_id(settings.name)
    if machine is None:
        machine = await asyncio.to_thread(hardware.detect_profile)
    if settings.redis_url is not None:
        if the_plan is None:
            the_plan = await asyncio.to_thread(plan, settings, path_env, machine)
        serving = _Serving(settings, machine, path_env, on_ready, shards=PULL_NO_SHARDS)
        memory = hardware.MemoryProbe(machine, settings.gpu_devices)
        await _pull(
            settings,
            serving,
            the_plan,
            _registration(worker_id, settings, machine, serving, memory),
            memory,
            stop,
        )
        return
    outbox = Outbox()
    runner = JobRunner(outbox)
    image_plans = await asyncio.to_thread(plan_images, settings)
    text = the_plan is not None or needs_router_default(settings)
    routers = _routers(settings)
    async with loopback.session() as session:
        split = await _split_models(settings, machine, path_env)
        if isinstance(split, str):
            shards: ShardFactory | str = split
            memory = hardware.MemoryProbe(machine, settings.gpu_devices)
        else:
            tools, stage_devices = split
            shards = _shard_host(tools, outbox, runner, session, routers)
            memory = hardware.MemoryProbe(machine, settings.gpu_devices, stage_devices)
        serving = _Serving(
            settings,
            machine,
            path_env,
            on_ready,
            shards=shards,
            image_plans=image_plans,
            images_give_state=not text,
            gpus_unused=None
            if the_plan or not text
            else await asyncio.to_thread(gpus_unused_before_plan, settings, path_env, machine),
        )
        if serving.images is not None:
            runner.serve(IMAGE_ENDPOINTS, serving.images.run_job)
        link = RouterLink(
            routers,
            _registration(worker_id, settings, machine, serving, memory),
            runner,
            outbox,
            memory=memory,
            shards=serving.shard_orders(outbox.send),
            model_control=serving.control_model,
        )
        serving.links.append(link)

        async def until_answered() -> None:
            """Every job ended here, and its final message written to the router."""
            await runner.until_idle()
            await outbox.until_answered()

        serves = the_plan.model.name if the_plan else "the router's default model"
        log.info(
            "worker %s (%s) serving %s, dialing %s",
            worker_id,
            settings.name,
            serves if text else "no text",
            ", ".join(settings.ws_urls),
        )
        try:
            async with asyncio.TaskGroup() as tg:
                timeout = settings.drain_timeout
                tg.create_task(
                    drain(stop, link, lambda: runner.running, until_answered, timeout, worker_id)
                )
                await _serve(serving, the_plan, text, link, tg, runner, session)
        except* Drained:
            pass


async def _serve(
    serving: _Serving,
    the_plan: Plan | None,
    text: bool,
    link: RouterLink,
    tg: asyncio.TaskGroup,
    runner: JobRunner,
    session: aiohttp.ClientSession,
) -> None:
    """Start what the worker serves in ``tg``, then serve its router link."""
    if serving.shards is not None:
        tg.create_task(serving.shards.run())
    if serving.images is not None:
        tg.create_task(serving.images.run())
    if the_plan is not None:
        await serving.start(the_plan, tg, runner, session)
    elif text:
        tg.create_task(serving.adopt_default(link, tg, runner, session))
    else:
        tg.create_task(runner.run())  # image models only
    await link.run()


async def _split_models(
    settings: WorkerSettings, machine: MachineProfile, path_env: str | None
) -> tuple[ShardTools, tuple[ComputeDevice, ...]] | str:
    """The llama.cpp build split models run on here and the devices a stage computes on, or
    why this worker cannot take part in split models."""
    if settings.backend_url is not None:
        return NO_LLAMA_CPP
    try:
        tools = await asyncio.to_thread(_shard_tools, settings, machine, path_env)
        listed = await asyncio.to_thread(tools.devices)
    except (LlamaCppError, hardware.HardwareError) as exc:
        log.warning("this worker cannot take part in split models: %s", exc)
        return f"cannot run split models here: {exc}"
    log.info(
        "split-model stages here compute on %s",
        ", ".join(f"{d.name} ({d.description})" for d in listed) or "the CPU",
    )
    return tools, listed


def _shard_host(
    tools: ShardTools,
    outbox: Outbox,
    runner: JobRunner,
    session: aiohttp.ClientSession,
    routers: Routers,
) -> ShardFactory:
    """This worker's part in split models, once it knows what to tell of their changes."""
    tls = routers.tls if routers.url.startswith("wss:") else None
    tunnels = TunnelEnds(routers.host, tls)

    def build(on_models: Callable[[], None]) -> ShardHost:
        return ShardHost(tools, outbox.send, runner, session, tunnels, on_models)

    return build


def _shard_tools(
    settings: WorkerSettings, machine: MachineProfile, path_env: str | None
) -> ShardTools:
    """The llama.cpp build split models run on here (no download: the worker's own)."""
    found = llama_cpp_binaries(settings, path_env, allow_build=False, gpus=machine.gpus)
    own = settings.model_copy(update={"model_path": None})  # a head loads what it is told

    def resolve(spec: ShardStart) -> Path:
        if spec.file is not None:
            return pinned_model(own, spec.file, machine)
        return local_model(own, spec.source, machine).path

    def layer_source(spec: ShardStart) -> tuple[Path, str]:
        return stage_source(own, spec, machine)

    names = hardware.device_names(machine, settings.gpu_devices)

    def devices() -> tuple[ComputeDevice, ...]:
        return stage_devices(list_devices(found.llama_server), names)

    env = spin_env(os.environ) | hardware.device_environment(machine, settings.gpu_devices)
    build = server_version(found.llama_server)

    return ShardTools(
        llama_server=found.llama_server,
        rpc_server=found.rpc_server,
        build=build,
        logs=logs_dir(settings.cache_dir),
        threads=settings.threads,
        stage_threads=stage_threads(settings.threads, machine.cpu),
        env=tuple(env.items()),
        rpc_host=settings.rpc_host,
        resolve=resolve,
        layer_source=layer_source,
        devices=devices,
        rpc_cache=_rpc_cache(settings, build),
    )


def _rpc_cache(settings: WorkerSettings, build: str) -> RpcCache | None:
    """ggml-rpc-server's tensor cache for this llama.cpp build (None: turned off)."""
    if settings.rpc_cache_max <= 0:
        return None
    folder = rpc_cache_dir(settings.rpc_cache_dir or settings.cache_dir, build)
    return RpcCache(folder, int(settings.rpc_cache_max * GIB))


async def _pull(
    settings: WorkerSettings,
    serving: _Serving,
    the_plan: Plan,
    register: Callable[[], Register],
    memory: hardware.MemoryProbe,
    stop: Drain,
) -> None:
    """Pull mode: serve jobs from the Redis job queue until cancelled or drained."""
    assert settings.redis_url is not None
    url = settings.redis_url.get_secret_value()
    client = redis_client(url)
    puller = RedisPuller(
        client,
        settings.redis_prefix,
        register,
        memory=memory,
        lease_ms=int(settings.queue_lease * 1000),
        resume_attempts=settings.resume_attempts,
    )
    serving.links.append(puller)
    log.info(
        "worker %s (%s) serving %s, taking jobs from Redis at %s (prefix %r)",
        puller.worker_id,
        settings.name,
        the_plan.model.name,
        redis_address(url),
        settings.redis_prefix,
    )
    try:
        async with (
            loopback.session() as session,
            asyncio.TaskGroup() as tg,
        ):
            # The runner task is created first, so it is open when the puller first claims.
            await serving.start(the_plan, tg, puller.runner, session)
            running, until = (lambda: puller.running), puller.runner.until_idle
            name = puller.worker_id
            tg.create_task(drain(stop, puller, running, until, settings.drain_timeout, name))
            await puller.run()
    except* Drained:
        pass
    finally:
        await client.aclose()


async def _target(
    settings: WorkerSettings,
    the_plan: Plan,
    supervisor: LlamaServer | AttachedServer,
    session: aiohttp.ClientSession,
) -> BackendTarget:
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
