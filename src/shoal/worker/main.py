"""The worker's composition root: resolve what to run, then run it all in one task group."""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from shoal import __version__
from shoal.llama_cpp.locate import resolve as resolve_binaries
from shoal.models.resolve import LocalModel, resolve_model
from shoal.models.store_client import fetch_from_store
from shoal.paths import logs_dir, models_dir
from shoal.protocol.ids import ModelName, new_worker_id
from shoal.protocol.messages import (
    PROTOCOL_VERSION,
    BackendState,
    Endpoint,
    ModelInfo,
    Register,
)
from shoal.worker import hardware
from shoal.worker.attached import AttachedServer
from shoal.worker.backend import Backend, BackendTarget, discover_model
from shoal.worker.link import RouterLink
from shoal.worker.llama_server import LlamaServer, LlamaServerConfig
from shoal.worker.outbox import Outbox
from shoal.worker.runner import JobRunner
from shoal.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

# Generous: the router's own request timeouts apply; a long answer must not be cut here.
BACKEND_KEEPALIVE_S = 3.0
"""Under llama-server's own 5 s idle limit, so we never write to a connection it is closing."""
BACKEND_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=10.0, sock_connect=10.0)


@dataclass(frozen=True)
class Plan:
    """What this worker will serve, decided before anything starts."""

    model: ModelInfo
    llama: LlamaServerConfig | None


def plan(settings: WorkerSettings, path_env: str | None) -> Plan:
    endpoints = (
        (Endpoint.EMBEDDINGS,) if settings.embedding else (Endpoint.CHAT, Endpoint.COMPLETIONS)
    )
    if settings.backend_url:
        alias = settings.model_alias or settings.backend_model or settings.model
        return Plan(
            ModelInfo(
                name=ModelName(alias),
                endpoints=endpoints,
                backend=f"attached {settings.backend_url}",
            ),
            None,
        )
    binaries = resolve_binaries(
        explicit=settings.llama_server_path, cache_dir=settings.cache_dir, path_env=path_env
    )
    log.info("llama-server: %s", binaries.reason)
    local = _local_model(settings)
    alias = settings.model_alias or local.id
    config = LlamaServerConfig(
        binary=binaries.llama_server,
        model_path=local.path,
        alias=alias,
        slots=settings.slots,
        ctx_size=settings.ctx_size,
        threads=settings.threads,
        embedding=settings.embedding,
        extra_args=_extra_args(settings.llama_server_args),
        log_file=logs_dir(settings.cache_dir) / f"llama-server-{alias.replace('/', '_')}.log",
        max_restarts=settings.max_restarts,
    )
    info = ModelInfo(
        name=ModelName(alias),
        endpoints=endpoints,
        context_length=settings.ctx_size,
        backend="llama-server",
    )
    return Plan(info, config)


def _local_model(settings: WorkerSettings) -> LocalModel:
    """``--model`` as a file on this machine: a path, the cache, or the model store."""
    if settings.model_store is None or settings.model.lower().endswith(".gguf"):
        return resolve_model(settings.model, settings.cache_dir)
    key = settings.gpu_key.get_secret_value() if settings.gpu_key else None
    dest = models_dir(settings.cache_dir) / "store"
    path = asyncio.run(fetch_from_store(settings.model_store, settings.model, dest, api_key=key))
    return LocalModel(id=settings.model.lower(), path=path)


class WorkerConfigError(Exception):
    pass


def _extra_args(text: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise WorkerConfigError(f"--llama-server-args is not valid shell quoting: {exc}") from None


async def run_worker(
    settings: WorkerSettings, the_plan: Plan, on_ready: Callable[[], None] | None = None
) -> None:
    """Run until cancelled. Raises ``link.Refusal`` when the router will never accept us."""
    worker_id = new_worker_id(settings.name)
    outbox = Outbox()
    runner = JobRunner(outbox)
    supervisor: LlamaServer | AttachedServer
    state_sink: list[RouterLink] = []

    def on_state(state: BackendState, detail: str) -> None:
        for link in state_sink:
            link.on_backend_state(state, detail)
        if state is BackendState.READY and on_ready is not None:
            on_ready()

    if the_plan.llama is not None:
        supervisor = LlamaServer(the_plan.llama, on_state)
    else:
        assert settings.backend_url is not None
        supervisor = AttachedServer(settings.backend_url.rstrip("/"), on_state)

    def register() -> Register:
        return Register(
            protocol_version=PROTOCOL_VERSION,
            worker_id=worker_id,
            name=settings.name,
            hardware=hardware.detect(),
            models=(the_plan.model,),
            slots=settings.slots,
            state=supervisor.state,
            backend_url=supervisor.url or None,
            software=f"shoal {__version__}",
        )

    gpu_key = settings.gpu_key.get_secret_value() if settings.gpu_key else None
    link = RouterLink(settings.ws_url, gpu_key, register, runner, outbox)
    state_sink.append(link)
    log.info(
        "worker %s (%s) serving %s, dialing %s",
        worker_id,
        settings.name,
        the_plan.model.name,
        settings.ws_url,
    )
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=BACKEND_KEEPALIVE_S)
    async with (
        aiohttp.ClientSession(connector=connector, timeout=BACKEND_TIMEOUT) as session,
        asyncio.TaskGroup() as tg,
    ):
        tg.create_task(supervisor.run())
        target = await _target(settings, the_plan, supervisor, session)
        tg.create_task(runner.run(Backend(target, session, lambda: supervisor.url)))
        await link.run()


async def _target(
    settings: WorkerSettings,
    the_plan: Plan,
    supervisor: LlamaServer | AttachedServer,
    session: aiohttp.ClientSession,
) -> BackendTarget:
    api_key = settings.backend_api_key.get_secret_value() if settings.backend_api_key else None
    if isinstance(supervisor, LlamaServer):
        return BackendTarget(the_plan.model.name, stream_upstream=True)
    backend_model = settings.backend_model
    if backend_model is None:
        await supervisor.ready.wait()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        backend_model = await discover_model(session, supervisor.url, headers)
        log.info("attached backend %s serves %r", supervisor.url, backend_model)
    rename = backend_model if backend_model != the_plan.model.name else None
    return BackendTarget(the_plan.model.name, rename, api_key)
