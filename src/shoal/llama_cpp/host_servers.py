"""The llama.cpp servers already running on this machine, and the threads each computes with.

Any user's ``llama-server`` and ``ggml-rpc-server`` count (other workers', a user's own), read
from their command lines: ``-t``/``--threads`` and ``-tb``/``--threads-batch``, else what
llama.cpp picks without them (``default_threads``). A thread count from the process table would
not do: a llama-server also runs HTTP threads that do not compute. ``threads_in_args`` is the
parser (pure); ``running_servers`` reads the process table.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from shoal.hardware.profile import CpuInfo

log = logging.getLogger(__name__)

LLAMA_SERVER = "llama-server"
RPC_SERVERS = ("ggml-rpc-server", "rpc-server")
"""``rpc-server`` is ggml-rpc-server's name in llama.cpp builds before the rename."""
_THREADS = ("-t", "--threads")
_BATCH_THREADS = ("-tb", "--threads-batch")


@dataclass(frozen=True)
class RunningServer:
    pid: int
    name: str
    threads: int
    """The most threads it computes with at once."""


def threads_in_args(argv: Sequence[str]) -> int | None:
    """The most threads a llama.cpp server started with ``argv`` computes with, as its flags
    say (the last of each flag counts, as in llama.cpp); None when they do not say."""
    found: dict[str, int] = {}
    for flag, value in zip(argv, argv[1:], strict=False):
        kind = "t" if flag in _THREADS else "tb" if flag in _BATCH_THREADS else None
        if kind is not None and value.isdigit() and int(value) > 0:
            found[kind] = int(value)
    if not found:
        return None
    return max(found.values())


def default_threads(name: str, cpu: CpuInfo) -> int:
    """What llama.cpp picks without ``-t``: llama-server one thread per physical core,
    ggml-rpc-server half the hardware threads."""
    if name == LLAMA_SERVER:
        return max(1, cpu.physical_cores or cpu.logical_cores)
    return max(1, cpu.logical_cores // 2)


def running_servers(cpu: CpuInfo) -> tuple[RunningServer, ...]:
    """Every llama.cpp server running on this machine now (a process that ends while it is
    looked at is left out). Blocking (the process table)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:  # exited, not yet reaped
            continue
        argv: list[str] = proc.info["cmdline"] or []
        name = _server_name(proc.info["name"] or "", argv)
        if name is None:
            continue
        threads = threads_in_args(argv) or default_threads(name, cpu)
        found.append(RunningServer(proc.pid, name, threads))
    return tuple(found)


def _server_name(name: str, argv: Sequence[str]) -> str | None:
    """The llama.cpp server a process is (by its name or executable), or None."""
    for candidate in (name, Path(argv[0]).name if argv else ""):
        if candidate == LLAMA_SERVER or candidate in RPC_SERVERS:
            return candidate
    return None
