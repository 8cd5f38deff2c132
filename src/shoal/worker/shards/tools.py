"""What split models need from this worker, decided once at start: its llama.cpp build, the
devices a stage computes on, where a shard's model comes from (``ShardTools``), or why this
worker cannot take part in split models.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shoal.hardware.profile import MachineProfile
from shoal.llama_cpp.devices import ComputeDevice, list_devices, stage_devices
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.options import binaries as llama_cpp_binaries
from shoal.llama_cpp.rpc_cache import RpcCache
from shoal.llama_cpp.threads import spin_env, stage_threads
from shoal.llama_cpp.version import server_version
from shoal.paths import logs_dir, rpc_cache_dir
from shoal.protocol.shards import ShardStart
from shoal.units import GIB
from shoal.worker import hardware
from shoal.worker.settings import WorkerSettings
from shoal.worker.text.plan import local_model, pinned_model, stage_source, store_model

log = logging.getLogger(__name__)

NO_LLAMA_CPP = "this worker runs no llama.cpp of its own (--backend-url)"
"""Why a worker with an attached backend takes no part in split models."""


@dataclass(frozen=True)
class ShardTools:
    """What shards need from the worker, decided once at start."""

    llama_server: Path
    rpc_server: Path | None
    build: str
    logs: Path
    threads: int | None
    """``llama-server --threads`` for heads (None: llama.cpp's own choice)."""
    stage_threads: int
    """``ggml-rpc-server -t`` (``llama_cpp.threads.stage_threads``)."""
    env: tuple[tuple[str, str], ...]
    """Added to every shard process's environment (``llama_cpp.threads.spin_env``)."""
    rpc_host: str | None
    """Direct mode: the address stages listen on (None: this worker refuses direct mode)."""
    resolve: Callable[[ShardStart], Path]
    """A shard's model (the file the router pinned, else its source: a model-store id or a
    path) -> the GGUF on this machine. Blocking."""
    layer_source: Callable[[ShardStart], tuple[Path, str]]
    """A stage's model and layers -> a GGUF holding at least those layers' hashed tensors and
    where they came from: ``local`` (a copy here), ``store`` (the store's pull of them) or
    ``hub`` (their byte ranges from Hugging Face). Blocking."""
    devices: Callable[[], tuple[ComputeDevice, ...]]
    """The devices a stage computes on, listed now (``llama_cpp.devices``; () for the CPU).
    Blocking."""
    rpc_cache: RpcCache | None
    """``ggml-rpc-server -c``'s cache, which stages pre-seed (None: no cache, no seeding)."""


async def split_models(
    settings: WorkerSettings, machine: MachineProfile, path_env: str | None
) -> tuple[ShardTools, tuple[ComputeDevice, ...]] | str:
    """The llama.cpp build split models run on here and the devices a stage computes on, or
    why this worker cannot take part in split models."""
    if settings.backend_url is not None:
        return NO_LLAMA_CPP
    try:
        tools = await asyncio.to_thread(shard_tools, settings, machine, path_env)
        listed = await asyncio.to_thread(tools.devices)
    except (LlamaCppError, hardware.HardwareError) as exc:
        log.warning("this worker cannot take part in split models: %s", exc)
        return f"cannot run split models here: {exc}"
    log.info(
        "split-model stages here compute on %s",
        ", ".join(f"{d.name} ({d.description})" for d in listed) or "the CPU",
    )
    return tools, listed


def shard_tools(
    settings: WorkerSettings, machine: MachineProfile, path_env: str | None
) -> ShardTools:
    """The llama.cpp build split models run on here (no download: the worker's own)."""
    found = llama_cpp_binaries(settings, path_env, allow_build=False, gpus=machine.gpus)
    own = settings.model_copy(update={"model_path": None})  # a head loads what it is told

    def resolve(spec: ShardStart) -> Path:
        if spec.store is not None:
            return store_model(own, spec.store)
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
