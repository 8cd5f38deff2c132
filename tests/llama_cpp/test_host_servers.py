"""The llama.cpp servers running on this machine and their threads: the flags parsed, and a
real llama-server found in the process table."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cluster import free_port, wait_until
from shoal.hardware.profile import CpuInfo
from shoal.llama_cpp.host_servers import (
    RunningServer,
    default_threads,
    running_servers,
    threads_in_args,
)


@pytest.mark.parametrize(
    ("argv", "threads"),
    [
        (["llama-server", "-m", "x.gguf"], None),
        (["llama-server", "-t", "3"], 3),
        (["llama-server", "--threads", "3"], 3),
        (["llama-server", "-t", "2", "-tb", "6"], 6),  # prompts are read with 6 at once
        (["llama-server", "--threads-batch", "4"], 4),
        (["llama-server", "-t", "2", "--threads", "5"], 5),  # the last one counts
        (["llama-server", "-t", "-1"], None),  # llama.cpp's "auto"
        (["llama-server", "-t"], None),
        (["llama-server", "--alias", "-t", "x"], None),
        (["ggml-rpc-server", "-H", "127.0.0.1", "-p", "50052", "-t", "2"], 2),
    ],
)
def test_threads_from_the_command_line(argv: list[str], threads: int | None) -> None:
    assert threads_in_args(argv) == threads


def test_without_flags_what_llama_cpp_picks() -> None:
    cpu = CpuInfo(model="x", logical_cores=16, physical_cores=8)
    assert default_threads("llama-server", cpu) == 8
    assert default_threads("ggml-rpc-server", cpu) == 8
    assert default_threads("llama-server", CpuInfo(model="x", logical_cores=4)) == 4
    assert default_threads("ggml-rpc-server", CpuInfo(model="x", logical_cores=1)) == 1


def test_a_running_llama_server_is_found_with_its_threads(
    llama_server: Path, model_path: Path
) -> None:
    argv = [str(llama_server), "-m", str(model_path), "--port", str(free_port())]
    proc = subprocess.Popen(
        [*argv, "--threads", "3", "--threads-batch", "5"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        cpu = CpuInfo(model="x", logical_cores=2, physical_cores=2)
        found = wait_until(
            lambda: [s for s in running_servers(cpu) if s.pid == proc.pid], 10, "it listed"
        )
        assert found == [RunningServer(proc.pid, "llama-server", 5)]
    finally:
        proc.terminate()
        proc.wait(10)
    assert all(s.pid != proc.pid for s in running_servers(cpu))
