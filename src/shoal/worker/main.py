"""The worker's composition root: resolve what to run (``text/plan.py``, ``images/plan.py``),
build its parts (``serving.py``, the link, the job runner, the shard host), then run them all
in one task group.

A worker started with ``--model`` (or ``--model-path``) resolves its model before it dials the
router, so mistakes fail fast. One started without learns the router's default model from the
``registered`` reply, resolves it then, and tells the router with a ``models`` message.

With ``--redis-url`` (pull mode) no router is dialed: a ``RedisPuller`` takes jobs straight
from the Redis job queue, and a worker started without a model serves Shoal's default model.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from shoal import __version__
from shoal.hardware.profile import MachineProfile
from shoal.protocol.ids import WorkerId, new_worker_id
from shoal.protocol.messages import IMAGE_ENDPOINTS, PROTOCOL_VERSION, JobLoading, Register
from shoal.worker import hardware
from shoal.worker.images.plan import plan_images
from shoal.worker.jobs.runner import JobRunner
from shoal.worker.link.drain import Drain, Drained, drain
from shoal.worker.link.outbox import Outbox
from shoal.worker.link.redis_pull import RedisPuller, redis_address, redis_client
from shoal.worker.link.router_link import RouterLink, Routers
from shoal.worker.serving import Serving, ShardFactory, TextPlan
from shoal.worker.settings import WorkerSettings
from shoal.worker.shards.host import ShardHost
from shoal.worker.shards.tools import ShardTools, split_models
from shoal.worker.shards.tunnels import TunnelEnds
from shoal.worker.text import loopback
from shoal.worker.text.plan import gpus_unused_before_plan, needs_router_default, plan
from shoal.worker.tls import client_tls_context

log = logging.getLogger(__name__)


PULL_NO_SHARDS = "a pull-mode worker (--redis-url) takes no part in split models"


def _registration(
    worker_id: WorkerId,
    settings: WorkerSettings,
    machine: MachineProfile,
    serving: Serving,
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
            slots=serving.text_slots
            or (settings.image_slots if serving.images else settings.slots),
            state=serving.state,
            backend_url=serving.backend_url,
            software=f"shoal {__version__}",
            stage_memory_bytes=memory.stage_memory(),
            shard_devices=memory.shard_devices(),
            no_shards=serving.no_shards,
            shard_ram_bytes=int(settings.shard_ram * 2**30) if settings.shard_ram else None,
            gpus_unused=serving.plan.gpus_unused if serving.plan else serving.early_gpus_unused,
            model_budget_bytes=serving.model_budget.total if serving.model_budget else None,
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
    the_plan: TextPlan | None,
    on_ready: Callable[[], None] | None = None,
    *,
    path_env: str | None = None,
    machine: MachineProfile | None = None,
    stop: Drain | None = None,
) -> None:
    """Run until cancelled, or until ``stop`` is requested and the drain ends (``link/drain.py``).
    Raises ``link.Refusal`` when the router will never accept us.

    With ``the_plan`` None the model is the router's default, resolved after registering
    (in pull mode, Shoal's default model, resolved first). A tuple of planned models: several
    text models (``text/residency/``), with a router or in pull mode.
    """
    stop = stop or Drain()
    worker_id = new_worker_id(settings.name)
    if machine is None:
        machine = await asyncio.to_thread(hardware.detect_profile)
    if settings.redis_url is not None:
        if the_plan is None:
            the_plan = await asyncio.to_thread(plan, settings, path_env, machine)
        serving = Serving(settings, machine, path_env, on_ready, shards=PULL_NO_SHARDS)
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
        split = await split_models(settings, machine, path_env)
        if isinstance(split, str):
            shards: ShardFactory | str = split
            memory = hardware.MemoryProbe(machine, settings.gpu_devices)
        else:
            tools, stage_devices = split
            shards = _shard_host(tools, outbox, runner, session, routers)
            memory = hardware.MemoryProbe(machine, settings.gpu_devices, stage_devices)
        serving = Serving(
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

        serves = _serves(the_plan)
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
                await _serve(serving, the_plan, text, link, tg, runner, session, outbox.send)
        except* Drained:
            pass


def _serves(the_plan: TextPlan | None) -> str:
    if the_plan is None:
        return "the router's default model"
    if isinstance(the_plan, tuple):
        return ", ".join(p.plan.model.name for p in the_plan)
    return the_plan.model.name


async def _serve(
    serving: Serving,
    the_plan: TextPlan | None,
    text: bool,
    link: RouterLink,
    tg: asyncio.TaskGroup,
    runner: JobRunner,
    session: aiohttp.ClientSession,
    loading: Callable[[JobLoading], None],
) -> None:
    """Start what the worker serves in ``tg``, then serve its router link."""
    if serving.shards is not None:
        tg.create_task(serving.shards.run())
    if serving.images is not None:
        tg.create_task(serving.images.run())
    if the_plan is not None:
        await serving.start(the_plan, tg, runner, session, loading)
    elif text:
        tg.create_task(serving.adopt_default(link, tg, runner, session))
    else:
        tg.create_task(runner.run())  # image models only
    await link.run()


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


async def _pull(
    settings: WorkerSettings,
    serving: Serving,
    the_plan: TextPlan,
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
        _serves(the_plan),
        redis_address(url),
        settings.redis_prefix,
    )
    try:
        async with (
            loopback.session() as session,
            asyncio.TaskGroup() as tg,
        ):
            # The runner task is created first, so it is open when the puller first claims.
            await serving.start(the_plan, tg, puller.runner, session, puller.loading)
            running, until = (lambda: puller.running), puller.runner.until_idle
            name = puller.worker_id
            tg.create_task(drain(stop, puller, running, until, settings.drain_timeout, name))
            await puller.run()
    except* Drained:
        pass
    finally:
        await client.aclose()
