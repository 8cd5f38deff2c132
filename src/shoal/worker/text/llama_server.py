"""llama-server as a supervised subprocess, with its own state machine.

    LOADING ──/health ok──▶ READY ──exit or hang──▶ RESTARTING ──backoff──▶ LOADING
       │  ▲                   │                        │
       │  │                   └──idle_unload_s without jobs, or unload()──▶ UNLOADED
       │  └──a job arrives (it waits for READY)──────────────────┘
       └──exit while loading───────────────────────────┘
    too many exits within CRASH_WINDOW_S ──▶ FAILED (stays; the reason names the last log lines)

One started with ``start_unloaded`` begins UNLOADED: nothing runs until a job (or ``load``)
wants it. ``unload`` stops a READY one on demand (a worker evicting it to make room for
another model) and returns once its process is gone, its memory freed. Each load's lines
up to ready (``load_log``: where llama-server reports its buffers) and its start->ready
seconds (``load_seconds``) are kept.

``ALLOWED`` is that diagram as a table (``shoal.lifecycle``); any other move raises
``IllegalTransition``.

A hang is found two ways: while no job holds it, three failed ``/health`` checks in a row
(``HEALTH_PERIOD_S`` apart); while jobs hold it, no answer to ``/health`` for
``stall_timeout_s`` (``stall.py``: probed every quarter of it). A process found hung while
jobs wait is killed at once (SIGKILL: a stopped process acts on nothing else), which ends
its jobs' streams: the worker reports them as a backend that died mid-answer, and the
router has them go on elsewhere.

The process gets SIGTERM then SIGKILL in a ``finally``, and is killed with the worker on Linux
(PR_SET_PDEATHSIG), so no llama-server outlives its worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from shoal.lifecycle import Transitions
from shoal.protocol.messages import BackendState
from shoal.worker.backoff import Backoff
from shoal.worker.lifecycle import BackendLifecycle, NotServing, StateCallback
from shoal.worker.settings import DEFAULT_STALL_TIMEOUT_S
from shoal.worker.text import stall

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
LOAD_TIMEOUT_S = 600.0
HEALTH_PERIOD_S = 10.0
HEALTH_TIMEOUT_S = 5.0
HEALTH_FAILURES_BEFORE_RESTART = 3
CRASH_WINDOW_S = 60.0
LOG_TAIL_LINES = 40
READY_MARKERS = (b"listening on http",)

ALLOWED = Transitions(
    {
        BackendState.LOADING: frozenset(
            {BackendState.READY, BackendState.RESTARTING, BackendState.FAILED}
        ),
        BackendState.READY: frozenset(
            {BackendState.UNLOADED, BackendState.RESTARTING, BackendState.FAILED}
        ),
        BackendState.RESTARTING: frozenset({BackendState.LOADING}),
        BackendState.UNLOADED: frozenset({BackendState.LOADING}),
        BackendState.FAILED: frozenset(),
    }
)
"""llama-server's lifecycle (the wire's ``BackendState`` names its states)."""


@dataclass(frozen=True)
class LlamaServerConfig:
    binary: Path
    model_path: Path
    alias: str
    slots: int
    ctx_size: int
    log_file: Path
    threads: int | None = None
    """``--threads`` (None: llama.cpp's own choice)."""
    batch_threads: int | None = None
    """``--threads-batch`` (None: the same as ``threads``)."""
    embedding: bool = False
    extra_args: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    max_restarts: int = 5
    idle_unload_s: float = 0.0
    """Stop llama-server after this long without jobs (0: never); the next job loads it."""
    device_args: tuple[str, ...] = ()
    """``--device``/``--split-mode``/``--tensor-split`` for the GPUs this worker may use."""
    env: tuple[tuple[str, str], ...] = ()
    """Variables added to llama-server's environment (e.g. ``CUDA_DEVICE_ORDER``)."""
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    """While jobs hold it: seconds without an answer to ``/health`` after which it is killed
    and restarted (``stall.py``; 0: only the idle health check applies)."""
    slot_save_path: Path | None = None
    """``--slot-save-path``: the folder its slots' KV caches are saved to and restored from
    (``residency/kv_saves.py``; it must exist when llama-server starts). None: no slot
    actions (llama-server answers them 501)."""


def command(config: LlamaServerConfig, port: int) -> list[str]:
    """The exact llama-server command line: explicit, so placement never depends on auto-fit."""
    args = [
        str(config.binary),
        "--model",
        str(config.model_path),
        "--alias",
        config.alias,
        "--host",
        config.host,
        "--port",
        str(port),
        "--parallel",
        str(config.slots),
        "--ctx-size",
        str(config.ctx_size * config.slots),
        "--no-webui",
        *config.device_args,
    ]
    if config.threads:
        args += ["--threads", str(config.threads)]
    if config.batch_threads:
        args += ["--threads-batch", str(config.batch_threads)]
    if config.slot_save_path is not None:
        args += ["--slot-save-path", str(config.slot_save_path)]
    if config.embedding:
        args += ["--embedding"]
        if "--pooling" not in config.extra_args:
            args += ["--pooling", "mean"]
    return args + list(config.extra_args)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent() -> None:
    """Runs in the child before exec: ask Linux to SIGKILL it when the worker dies.

    SIGKILL, not SIGTERM: a worker that died cannot follow up a SIGTERM, and llama-server
    given SIGTERM while it loads or generates was seen to hang in its graceful shutdown for
    minutes (idle, in a futex wait) instead of exiting. It holds nothing worth a clean exit."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Exited(Exception):
    def __init__(self, returncode: int | None, why: str) -> None:
        super().__init__(why)
        self.returncode = returncode
        self.why = why


class Unloaded(Exited):
    """Stopped on purpose after idling; not a crash."""


class Hung(Exited):
    """Did not answer while jobs waited on it (``stall.py``); already killed."""


@dataclass
class LlamaServer:
    config: LlamaServerConfig
    on_state: StateCallback
    url: str = ""
    pid: int | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL_LINES))
    backoff: Backoff = field(default_factory=lambda: Backoff(base=1.0, cap=30.0))
    _crashes: deque[float] = field(default_factory=deque)
    _active_jobs: int = 0
    _busy_since: float | None = None
    """When jobs began to hold llama-server (None: none does)."""
    _busy: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while jobs hold llama-server (the stall watch probes then)."""
    _last_job_at: float = field(default_factory=time.monotonic)
    start_unloaded: bool = False
    """Begin UNLOADED: load only when a job (or ``load``) wants it."""
    loads: int = 0
    """Loads that reached READY."""
    load_seconds: float | None = None
    """The last load's seconds from start to READY (None: never loaded)."""
    load_log: list[str] = field(default_factory=list)
    """The lines the current (or last) process wrote up to ready."""
    _unload_why: str | None = None
    _unload_asked: asyncio.Event = field(default_factory=asyncio.Event)
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while no process of ours runs."""
    _life: BackendLifecycle = field(init=False)

    def __post_init__(self) -> None:
        name = f"llama-server {self.config.alias}"
        first = BackendState.UNLOADED if self.start_unloaded else BackendState.LOADING
        self._life = BackendLifecycle(name, ALLOWED, first, self.on_state, log)
        self._stopped.set()

    @property
    def detail(self) -> str:
        """Why it is in its state."""
        return self._life.detail

    @property
    def changed(self) -> asyncio.Event:
        """Set on its next move (``BackendLifecycle.changed``)."""
        return self._life.changed

    async def load(self) -> None:
        """Ask for a load (when UNLOADED) and wait until READY; raises ``NotServing`` if it
        fails for good meanwhile."""
        await self._life.until_ready(NotServing)

    async def unload(self, why: str) -> None:
        """Stop a READY llama-server now (READY -> UNLOADED) and wait until its process is
        gone; nothing when it is not READY. The caller makes sure no job holds it."""
        if self.state is not BackendState.READY:
            return
        self._unload_why = why
        self._unload_asked.set()
        while self.state is BackendState.READY:
            await self._life.changed.wait()
        await self._stopped.wait()

    @property
    def state(self) -> BackendState:
        return self._life.state

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[None]:
        """Hold llama-server for one job: load it first if it was unloaded, and wait if it is
        loading. Jobs in flight keep it from being unloaded.

        Raises ``NotServing`` if it fails for good while the job waits.
        """
        if not self._active_jobs:
            self._busy_since = time.monotonic()
            self._busy.set()
        self._active_jobs += 1
        try:
            await self._life.until_ready(NotServing)
            yield
        finally:
            self._active_jobs -= 1
            self._last_job_at = time.monotonic()
            if not self._active_jobs:
                self._busy_since = None
                self._busy.clear()

    def _idle_for(self) -> float | None:
        """Seconds left before an idle unload (<= 0: now), or None when it never unloads."""
        if not self.config.idle_unload_s:
            return None
        if self._active_jobs:
            return self.config.idle_unload_s
        return self._last_job_at + self.config.idle_unload_s - time.monotonic()

    async def run(self) -> None:
        """Keep llama-server running until cancelled or failed for good."""
        attempt = 0
        self.config.log_file.parent.mkdir(parents=True, exist_ok=True)
        if self.state is BackendState.UNLOADED:
            await self._life.load_when_wanted("a job arrived; loading")
        while True:
            started = time.monotonic()
            exit_ = await self._run_once()
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # Python 3.11's TaskGroup swallows a cancellation that comes while it cancels
                # its tasks after an error (the process ended, or was unloaded): carry it on.
                raise asyncio.CancelledError
            if isinstance(exit_, Unloaded):
                await self._life.load_when_wanted("a job arrived; loading again")
                continue
            if time.monotonic() - started > CRASH_WINDOW_S:
                attempt = 0
            now = time.monotonic()
            self._crashes.append(now)
            while self._crashes and now - self._crashes[0] > CRASH_WINDOW_S:
                self._crashes.popleft()
            if len(self._crashes) > self.config.max_restarts:
                self._life.move(BackendState.FAILED, self._failure_reason(exit_))
                await asyncio.Event().wait()  # stay failed until the worker stops
            delay = self.backoff.delay(attempt)
            attempt += 1
            self._life.move(BackendState.RESTARTING, f"{exit_.why}; restarting in {delay:.1f} s")
            await asyncio.sleep(delay)

    def _failure_reason(self, exit_: Exited) -> str:
        lines = " | ".join(line for line in list(self.tail)[-5:] if line)
        return (
            f"llama-server exited {len(self._crashes)} times within {CRASH_WINDOW_S:g} s and "
            f"will not be restarted (last: {exit_.why}). Last log lines: {lines}. "
            f"Full log: {self.config.log_file}"
        )

    async def _run_once(self) -> Exited:
        port = free_port(self.config.host)
        self.url = f"http://{self.config.host}:{port}"
        argv = command(self.config, port)
        if self.state is not BackendState.LOADING:
            self._life.move(BackendState.LOADING, "starting llama-server")
        log.info("starting %s", " ".join(argv))
        self.load_log = []
        self._unload_asked.clear()
        self._stopped.clear()
        with self.config.log_file.open("ab") as logf:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **dict(self.config.env)} if self.config.env else None,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
            self.pid = proc.pid
            ready = asyncio.Event()
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._drain(proc, logf, ready))
                    await self._supervise(proc, ready, tg)
            except* Exited as group:
                exited = group.exceptions[0]
            finally:
                await stop_process(proc)
                self.pid = None
                self._stopped.set()
        assert isinstance(exited, Exited)
        return exited

    async def _supervise(
        self, proc: asyncio.subprocess.Process, ready: asyncio.Event, tg: asyncio.TaskGroup
    ) -> None:
        """Wait until it loads, then watch it; raises ``Exited`` (or ``Hung``, from the stall
        watch, a task of ``tg``) when this run of it ends."""
        started = time.monotonic()
        waiter = asyncio.ensure_future(proc.wait())
        marker = asyncio.ensure_future(ready.wait())
        try:
            done, _ = await asyncio.wait(
                [waiter, marker], timeout=LOAD_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                raise Exited(None, f"not ready after {LOAD_TIMEOUT_S:g} s")
            if waiter.done():
                raise Exited(proc.returncode, f"exited with code {proc.returncode} while loading")
            async with aiohttp.ClientSession() as session:
                await self._wait_healthy(session, proc)
                self.loads += 1
                self.load_seconds = time.monotonic() - started
                self._life.move(BackendState.READY, f"serving on {self.url} (pid {proc.pid})")
                if self.config.stall_timeout_s > 0:
                    tg.create_task(self._watch_jobs(proc))
                await self._watch(session, waiter)
        finally:
            waiter.cancel()
            marker.cancel()

    async def _wait_healthy(
        self, session: aiohttp.ClientSession, proc: asyncio.subprocess.Process
    ) -> None:
        # The ready marker is logged once the model is loaded; /health confirms it answers.
        for _ in range(50):
            if await self._healthy(session):
                return
            if proc.returncode is not None:
                break
            await asyncio.sleep(0.1)
        raise Exited(proc.returncode, "never answered /health")

    async def _healthy(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.get(
                self.url + "/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _watch(self, session: aiohttp.ClientSession, waiter: asyncio.Future[Any]) -> None:
        """Liveness: the process is alive *and* /health answers. Also unloads when idle."""
        failures = 0
        self._last_job_at = time.monotonic()
        next_check = time.monotonic() + HEALTH_PERIOD_S
        while True:
            idle_left = self._idle_for()
            if idle_left is not None and idle_left <= 0:
                idle = self.config.idle_unload_s
                # Before stopping it, so no new job is let through to a dying process.
                self._life.move(BackendState.UNLOADED, f"no jobs for {idle:g} s; memory freed")
                raise Unloaded(None, "idle")
            if self._unload_asked.is_set():
                why = self._unload_why or "unloaded"
                self._life.move(BackendState.UNLOADED, why)
                raise Unloaded(None, why)
            wait = next_check - time.monotonic()
            if idle_left is not None:
                wait = min(wait, idle_left)
            asked: asyncio.Future[Any] = asyncio.ensure_future(self._unload_asked.wait())
            try:
                done, _ = await asyncio.wait(
                    {waiter, asked}, timeout=max(wait, 0.0), return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                asked.cancel()
            if waiter in done:
                raise Exited(waiter.result(), f"exited with code {waiter.result()}")
            if time.monotonic() < next_check:
                continue
            next_check = time.monotonic() + HEALTH_PERIOD_S
            failures = 0 if await self._healthy(session) else failures + 1
            if failures >= HEALTH_FAILURES_BEFORE_RESTART:
                raise Exited(None, f"/health failed {failures} times in a row")

    async def _watch_jobs(self, proc: asyncio.subprocess.Process) -> None:
        """While jobs hold llama-server, probe ``/health`` every ``stall.probe_every``; when it
        has not answered for the stall timeout, kill it and raise ``Hung``."""
        timeout = self.config.stall_timeout_s
        period = stall.probe_every(timeout, HEALTH_PERIOD_S)
        last_answer = time.monotonic()
        async with aiohttp.ClientSession() as session:
            while True:
                await self._busy.wait()
                busy_since = self._busy_since
                if busy_since is None:  # the jobs left as it was set
                    continue
                if stall.hung(time.monotonic(), last_answer, busy_since, timeout):
                    with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                        proc.kill()  # a stopped process acts on SIGKILL alone
                    why = (
                        f"no answer to /health for {timeout:g} s while it ran jobs "
                        f"(--backend-stall-timeout); killed pid {proc.pid}"
                    )
                    log.warning("llama-server %s: %s", self.config.alias, why)
                    raise Hung(None, why)
                asked = time.monotonic()
                due = stall.deadline(last_answer, busy_since, timeout)
                if await self._answers_by(session, due):
                    last_answer = time.monotonic()
                    due = stall.deadline(last_answer, busy_since, timeout)
                await asyncio.sleep(max(0.0, min(asked + period, due) - time.monotonic()))

    async def _answers_by(self, session: aiohttp.ClientSession, due: float) -> bool:
        """Whether ``/health`` answers ok before ``due`` (``time.monotonic()``)."""
        try:
            async with asyncio.timeout(max(0.0, due - time.monotonic())):
                return await self._healthy(session)
        except TimeoutError:
            return False

    async def _drain(
        self, proc: asyncio.subprocess.Process, logf: object, ready: asyncio.Event
    ) -> None:
        assert proc.stdout is not None
        write = logf.write  # type: ignore[attr-defined]  # a binary file object
        while line := await proc.stdout.readline():
            write(line)
            text = line.decode(errors="replace").rstrip()
            self.tail.append(text)
            if not ready.is_set():
                self.load_log.append(text)
            if not ready.is_set() and any(m in line for m in READY_MARKERS):
                # Whoever reads the log once it is ready (a split model's head reads where
                # the layers went) must find every line up to here, not a buffer short.
                logf.flush()  # type: ignore[attr-defined]
                ready.set()


async def stop_process(proc: asyncio.subprocess.Process, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM, wait ``grace`` seconds, then SIGKILL. Safe to call on an exited process."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        async with asyncio.timeout(grace):
            await proc.wait()
    except TimeoutError:
        log.warning("pid %d ignored SIGTERM for %g s; killing it", proc.pid, grace)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
