"""This worker's parts in models split by layers: stages and heads, each a supervised process.

A **stage** runs ``ggml-rpc-server`` on 127.0.0.1 (it has no authentication); the head
reaches it through the router's tunnel (``TunnelDial`` asks this worker to connect one more
head connection to it), or, in direct mode on a trusted network, straight at ``--rpc-host``.
With the RPC cache on (``--rpc-cache-max``), it first pre-seeds its layers' weights into the
cache (``rpc_seed``) and runs ``ggml-rpc-server -c``: the head then sends it no weights over
10 MiB. It reads them from, in this order: the model store's pull of its layers (a store
model), a copy it has (a path, or the file the router pinned already in its cache), or the
pinned file's byte ranges on Hugging Face (``models.hub_ranges``); never a whole download.

A **head** loads the whole GGUF in ``llama-server --rpc <stages> -ngl N --tensor-split ...``
with an explicit context and no automatic fit, so the layers land where the plan says; it
reads the placement back from the load log (``llama_cpp.load_log``), refuses a placement
that left out a stage, and then serves the split model like the worker's own: jobs for it
go to this llama-server (``JobRunner.route``). A head is never restarted on its own: when a
stage dies llama-server aborts, the shard reports ``failed`` and the router redeploys.

Every state change goes to the router as a ``ShardStatus``. A shard's lifecycle::

    STARTING ──listening (stage), loaded (head)──▶ READY
       │                                             │
       └──failed to start──▶ FAILED ◀──process died──┘
    STARTING, READY or FAILED ──stopped (ShardStop, or the worker stops)──▶ STOPPED

``ALLOWED`` is that diagram as a table (``shoal.lifecycle``); any other move raises
``IllegalTransition``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import aiohttp

from shoal.lifecycle import Lifecycle, Transitions
from shoal.llama_cpp.devices import ComputeDevice
from shoal.llama_cpp.load_log import placement
from shoal.llama_cpp.rpc_cache import RpcCache
from shoal.models.errors import ModelError
from shoal.protocol.ids import WorkerId
from shoal.protocol.messages import AGENT_ENDPOINTS, BackendState, Endpoint, Message, ModelInfo
from shoal.protocol.shards import (
    LINK_REPORT_S,
    DevicePlacement,
    SeedReport,
    ShardRole,
    ShardStart,
    ShardState,
    ShardStatus,
    TunnelDial,
)
from shoal.tunnel.endpoints import HeadEndpoint
from shoal.worker.jobs.runner import JobRunner
from shoal.worker.shards.rpc_seed import SeedOrder, seed
from shoal.worker.shards.tools import ShardTools
from shoal.worker.shards.tunnels import TunnelEnds, link_report
from shoal.worker.tasks import HeldGroup
from shoal.worker.text.backend import Backend, BackendTarget
from shoal.worker.text.llama_server import LlamaServer, LlamaServerConfig, free_port, stop_process

log = logging.getLogger(__name__)

RPC_READY_TIMEOUT_S = 30.0
"""ggml-rpc-server prints nothing flushed at start: readiness is its port accepting."""
LOCALHOST = "127.0.0.1"
CPU_DEVICE = "CPU"
RPC_DEVICE = "RPC"
"""llama-server's names for the stages' devices: ``RPC0``, ``RPC1``..."""

ALLOWED = Transitions(
    {
        ShardState.STARTING: frozenset({ShardState.READY, ShardState.FAILED, ShardState.STOPPED}),
        ShardState.READY: frozenset({ShardState.FAILED, ShardState.STOPPED}),
        ShardState.FAILED: frozenset({ShardState.STOPPED}),
        ShardState.STOPPED: frozenset(),
    }
)


@dataclass(eq=False)
class _Shard:
    spec: ShardStart
    task: asyncio.Task[None] | None = None
    rpc_port: int | None = None
    devices: tuple[int, ...] = ()
    """A stage: the free bytes of each device its ggml-rpc-server serves (() for the CPU)."""
    placement: tuple[DevicePlacement, ...] = ()
    seed: SeedReport | None = None
    changed_at: float = field(default_factory=time.monotonic)
    life: Lifecycle[ShardState] = field(init=False)

    def __post_init__(self) -> None:
        name = f"deployment {self.spec.deployment}: {self.spec.role.value} shard"
        self.life = Lifecycle(name, ALLOWED, ShardState.STARTING, log)

    @property
    def state(self) -> ShardState:
        return self.life.state


class ShardHost:
    """Runs the shards the router starts here, until cancelled (then stops them all)."""

    def __init__(
        self,
        tools: ShardTools,
        send: Callable[[Message], None],
        runner: JobRunner,
        session: aiohttp.ClientSession,
        tunnels: TunnelEnds,
        on_models: Callable[[], None],
    ) -> None:
        self.tools = tools
        self._send = send
        self._runner = runner
        self._session = session
        self._tunnels = tunnels
        self._on_models = on_models
        self._shards: dict[str, _Shard] = {}
        self._held = HeldGroup("shard host")

    @property
    def models(self) -> tuple[ModelInfo, ...]:
        """The split models this worker heads and serves now."""
        return tuple(
            ModelInfo(
                name=s.spec.model,
                endpoints=(Endpoint.CHAT, Endpoint.COMPLETIONS, *AGENT_ENDPOINTS),
                context_length=s.spec.ctx_size // s.spec.slots,
                backend=f"llama-server --rpc ({s.spec.deployment})",
            )
            for s in self._shards.values()
            if s.spec.role is ShardRole.HEAD and s.state is ShardState.READY
        )

    async def run(self) -> None:
        await self._held.hold(self._stop_all)

    def _stop_all(self) -> None:
        for shard in self._shards.values():
            if shard.task is not None:
                shard.task.cancel()

    # ------------------------------------------------------------ router's orders

    def start(self, spec: ShardStart) -> None:
        if not self._held.open:
            raise RuntimeError("shard host is not running")
        old = self._shards.get(spec.deployment)
        if old is not None and old.spec == spec and old.state is not ShardState.FAILED:
            self._send(self._status(old, "already running"))
            return
        self.stop(spec.deployment)
        shard = _Shard(spec)
        self._shards[spec.deployment] = shard
        self._send(self._status(shard, "starting"))  # says which build this worker runs
        run = self._stage if spec.role is ShardRole.STAGE else self._head
        shard.task = self._held.start(self._guard(shard, run(shard)))

    def stop(self, deployment: str) -> None:
        shard = self._shards.pop(deployment, None)
        if shard is None:
            return
        log.info("deployment %s: stopping the %s shard", deployment, shard.spec.role.value)
        if shard.task is not None:
            shard.task.cancel()
        if shard.spec.role is ShardRole.STAGE:
            self._tunnels.close_stage(deployment)
        if shard.spec.role is ShardRole.HEAD:
            self._runner.unroute(shard.spec.model)
            self._on_models()

    def dial(self, msg: TunnelDial) -> None:
        """The head opened one more connection to this stage through the router: join it."""
        shard = self._shards.get(msg.deployment)
        if not self._held.open or shard is None or shard.rpc_port is None:
            log.warning("deployment %s: tunnel dial for a stage not running here", msg.deployment)
            return
        self._held.start(self._tunnels.connect_stage(msg, LOCALHOST, shard.rpc_port))

    # ------------------------------------------------------------ shards

    async def _guard(self, shard: _Shard, work: Awaitable[None]) -> None:
        """Run a shard; whatever ends it is reported (cancellation: stopped)."""
        try:
            await work
            self._move(shard, ShardState.FAILED, "its process exited")
        except asyncio.CancelledError:
            self._move(shard, ShardState.STOPPED, "stopped")
            raise
        except Exception as exc:  # one shard's failure must not take the worker down
            log.exception("deployment %s: shard failed", shard.spec.deployment)
            self._move(shard, ShardState.FAILED, str(exc) or type(exc).__name__)
        finally:
            if (
                shard.spec.role is ShardRole.HEAD
                and self._shards.get(shard.spec.deployment) is shard
            ):
                self._runner.unroute(shard.spec.model)
                self._on_models()

    async def _stage(self, shard: _Shard) -> None:
        spec = shard.spec
        if self.tools.rpc_server is None:
            raise RuntimeError(
                "this worker has no ggml-rpc-server beside its llama-server; install llama.cpp "
                "with RPC (`shoal llama-cpp install`)"
            )
        host = LOCALHOST
        if spec.direct:
            if self.tools.rpc_host is None:
                raise RuntimeError(
                    "direct mode needs --rpc-host on this worker (the LAN address to listen "
                    "on; trusted networks only)"
                )
            host = self.tools.rpc_host
        env = {**os.environ, **dict(self.tools.env)}
        argv = [str(self.tools.rpc_server), "-t", str(self.tools.stage_threads)]
        if self.tools.rpc_cache is not None:
            shard.seed = await self._seed(spec, self.tools.rpc_cache)
            argv.append("-c")
            env["LLAMA_CACHE"] = str(self.tools.rpc_cache.llama_cache)
        port = free_port(host)
        argv += ["-H", host, "-p", str(port)]
        listed = await asyncio.to_thread(self.tools.devices)
        served = served_devices(spec.devices, listed)
        if served:
            argv += ["-d", ",".join(served)]
        free = {d.name: d.free_bytes for d in listed}
        shard.devices = tuple(free[name] for name in served if name in free)
        log_file = self.tools.logs / f"ggml-rpc-server-{_safe(spec.deployment)}.log"
        log_file.parent.mkdir(parents=True, exist_ok=True)
        log.info("deployment %s: starting %s", spec.deployment, " ".join(argv))
        with log_file.open("ab") as logf:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                env=env,
            )
            try:
                await _wait_listening(host, port, proc)
                shard.rpc_port = port
                address = f"{host}:{port}" if spec.direct else None
                self._move(shard, ShardState.READY, f"ggml-rpc-server on {host}:{port}", address)
                code = await proc.wait()
                raise RuntimeError(f"ggml-rpc-server exited with code {code}; log: {log_file}")
            finally:
                await stop_process(proc)

    async def _seed(self, spec: ShardStart, cache: RpcCache) -> SeedReport | None:
        """Pre-seed the stage's layers into the cache; a failure is reported, not fatal (the
        head then sends the weights itself)."""
        if spec.layers is None:
            return None
        began = time.monotonic()
        try:
            path, kind = await asyncio.to_thread(self.tools.layer_source, spec)
            order = SeedOrder(spec.deployment, path, *spec.layers, spec.output, kind)
            return await asyncio.to_thread(seed, cache, order)
        except (OSError, ValueError, ModelError) as exc:  # a source we cannot get, read or parse
            log.warning("deployment %s: pre-seeding failed: %s", spec.deployment, exc)
            return SeedReport(
                tensors=0, bytes=0, seconds=round(time.monotonic() - began, 3), error=str(exc)
            )

    async def _head(self, shard: _Shard) -> None:
        spec = shard.spec
        own = [d for d in spec.devices if not d.startswith(RPC_DEVICE)]
        if own:
            listed = await asyncio.to_thread(self.tools.devices)
            _check_listed(own, listed)
        path = await asyncio.to_thread(self.tools.resolve, spec)
        async with AsyncExitStack() as stack:
            rpc: list[str] = []
            ends: dict[WorkerId, HeadEndpoint] = {}
            for peer in spec.peers:
                if peer.direct is not None:
                    rpc.append(peer.direct)
                else:
                    end = await stack.enter_async_context(self._tunnels.head_end(peer))
                    ends[peer.worker_id] = end
                    rpc.append(f"{LOCALHOST}:{end.port}")
            log_file = self.tools.logs / f"llama-server-head-{_safe(spec.deployment)}.log"
            config = LlamaServerConfig(
                binary=self.tools.llama_server,
                model_path=path,
                alias=spec.model,
                slots=spec.slots,
                ctx_size=spec.ctx_size // spec.slots,
                log_file=log_file,
                threads=self.tools.threads,
                max_restarts=0,  # a stage died: the whole split is redeployed, not the head
                device_args=head_args(rpc, spec),
                env=self.tools.env,
            )
            log_file.parent.mkdir(parents=True, exist_ok=True)
            offset = log_file.stat().st_size if log_file.exists() else 0
            loaded = asyncio.Event()

            def on_state(state: BackendState, detail: str) -> None:
                if state is BackendState.READY:
                    loaded.set()
                elif state is BackendState.FAILED:
                    self._move(shard, ShardState.FAILED, detail)

            server = LlamaServer(config, on_state)
            async with asyncio.TaskGroup() as tg:
                running = tg.create_task(server.run())
                await loaded.wait()
                with log_file.open(errors="replace") as f:
                    f.seek(offset)
                    devices = placement(f, rpc)  # raises if a stage was left out
                shard.placement = tuple(
                    DevicePlacement(
                        device=d.device,
                        model_bytes=d.model_bytes,
                        kv_bytes=d.kv_bytes,
                        compute_bytes=d.compute_bytes,
                    )
                    for d in devices
                )
                target = BackendTarget(spec.model, stream_upstream=True, token_ids=True)
                backend = Backend(target, self._session, lambda: server.url)
                self._runner.route(spec.model, backend.run, server.use)
                self._move(shard, ShardState.READY, f"serving {spec.model} on {server.url}")
                self._on_models()
                reporting = tg.create_task(self._report_links(spec.deployment, ends))
                await running
                reporting.cancel()

    async def _report_links(self, deployment: str, ends: dict[WorkerId, HeadEndpoint]) -> None:
        """While the head serves: every ``LINK_REPORT_S``, its stages' round trips as it timed
        them, if a stage answered something since the last report (none in direct mode)."""
        sent: dict[WorkerId, tuple[int, ...]] = {}
        while ends:
            await asyncio.sleep(LINK_REPORT_S)  # a report's pace, not a wait for an event
            now = {w: tuple(end.turnarounds.copy()) for w, end in ends.items()}
            if (msg := link_report(deployment, now, sent)) is not None:
                self._send(msg)
                sent = now

    def _move(
        self, shard: _Shard, state: ShardState, detail: str, address: str | None = None
    ) -> None:
        if shard.state is state:
            return
        was_serving = shard.state is ShardState.READY
        shard.life.move(state, f"({detail})")
        shard.changed_at = time.monotonic()
        if shard.spec.role is ShardRole.HEAD and was_serving and state is not ShardState.READY:
            self._runner.unroute(shard.spec.model)  # no more jobs for a head that failed
            self._on_models()
        self._send(self._status(shard, detail, address))

    def _status(self, shard: _Shard, detail: str, address: str | None = None) -> ShardStatus:
        if address is None and shard.spec.direct and shard.rpc_port is not None:
            address = f"{self.tools.rpc_host}:{shard.rpc_port}"
        return ShardStatus(
            deployment=shard.spec.deployment,
            role=shard.spec.role,
            state=shard.state,
            detail=detail,
            build=self.tools.build,
            rpc_address=address,
            devices=shard.devices,
            placement=shard.placement,
            seed=shard.seed,
        )


def head_args(rpc: list[str], spec: ShardStart) -> tuple[str, ...]:
    """llama-server's arguments for a head: ``--rpc`` first (``--device`` names its devices,
    which exist once it is parsed), then the plan's offload (``offload_args``)."""
    args = ("--rpc", ",".join(rpc)) if rpc else ()
    # No automatic fit: the plan decides; -lv 4 makes the load log say where layers went.
    return (*args, *offload_args(spec), "--fit", "off", "--cache-ram", "0", "-lv", "4")


def offload_args(spec: ShardStart) -> tuple[str, ...]:
    """``-ngl``, ``--device`` (the head's GPUs that hold layers, then ``RPC<k>``; ``none``:
    nothing offloaded, so a GPU of the head the plan gave nothing stays out) and
    ``--tensor-split``, as the router planned them."""
    args = ["--n-gpu-layers", str(spec.n_gpu_layers), "--device", ",".join(spec.devices) or "none"]
    if spec.tensor_split:
        args += ["--tensor-split", ",".join(f"{x:g}" for x in spec.tensor_split)]
    return tuple(args)


def served_devices(named: tuple[str, ...], listed: tuple[ComputeDevice, ...]) -> tuple[str, ...]:
    """What a stage's ``ggml-rpc-server -d`` serves: the devices the router named (``CPU``
    and GPUs by llama.cpp's names), checked against what this build lists; none named (an
    older router): every GPU listed, or the CPU (ggml-rpc-server's own default)."""
    if not named:
        return tuple(d.name for d in listed)
    _check_listed([n for n in named if n.upper() != CPU_DEVICE], listed)
    return named


def _check_listed(names: list[str], listed: tuple[ComputeDevice, ...]) -> None:
    known = {d.name for d in listed}
    missing = [n for n in names if n not in known]
    if missing:
        raise RuntimeError(
            f"the router planned layers on {', '.join(missing)}, which this worker's llama.cpp "
            f"does not list (it lists: {', '.join(sorted(known)) or 'no GPU'}); the worker's "
            "GPUs changed since it registered, or --gpu-devices leaves them out"
        )


async def _wait_listening(host: str, port: int, proc: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + RPC_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise RuntimeError(f"ggml-rpc-server exited with code {proc.returncode} at start")
        with contextlib.suppress(OSError):
            # A bare connect: ggml-rpc-server serves one client at a time, and drops this one
            # at once when it sends nothing.
            _, writer = await asyncio.open_connection(host, port)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(
        f"ggml-rpc-server did not listen on {host}:{port} within {RPC_READY_TIMEOUT_S:g} s"
    )


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
