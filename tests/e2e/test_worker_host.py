"""A worker and the machine it starts on: the cores other llama.cpp servers already use, and
a model file cut short (issue 24)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from cluster import MODEL, STARTUP_TIMEOUT_S, Cluster, Proc, wait_until
from shoal.hardware.cpu_quota import detect_usable_cores
from shoal.hardware.detect import detect_machine
from shoal.llama_cpp.threads import SPINCOUNT

pytestmark = pytest.mark.e2e

TRUNCATED_EXIT_S = 60.0
"""A worker given a cut file exits before it starts anything, in the time Python takes to start
on a busy machine (0cc5c22 started llama-server six times, then stayed up, failed)."""


def _llama_server(worker: Proc) -> psutil.Process:
    def find() -> psutil.Process | None:
        children = psutil.Process(worker.pid).children(recursive=True)
        return next((p for p in children if p.name() == "llama-server"), None)

    found: psutil.Process = wait_until(find, STARTUP_TIMEOUT_S, "the worker's llama-server")
    return found


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _warnings(worker: Proc) -> list[str]:
    return [line for line in worker.log().splitlines() if "llama.cpp server(s) on" in line]


def test_a_second_worker_takes_the_cores_left_and_warns_when_they_are_too_few(
    cluster: Cluster,
) -> None:
    """The first worker's llama-server uses every core (--threads); a second one on the same
    machine gets one thread and a short OpenMP spin, and a WARNING that names the numbers
    and the fix; a third given --threads keeps them, and is warned too."""
    cores = detect_usable_cores(detect_machine().cpu)
    router = cluster.router()
    first = cluster.worker(router, name="first", threads=cores)
    router.wait_workers(1)
    first_argv = _llama_server(first).cmdline()
    assert _flag(first_argv, "--threads") == str(cores), first_argv

    second = cluster.worker(router, name="second", threads=None)
    router.wait_workers(2)
    server = _llama_server(second)
    argv = server.cmdline()
    assert (_flag(argv, "--threads"), _flag(argv, "--threads-batch")) == ("1", "1"), argv
    assert server.environ().get("GOMP_SPINCOUNT") == str(SPINCOUNT)
    [warning] = _warnings(second)
    assert " WARNING " in warning
    assert f"on {cores} usable cores" in warning and "this llama-server 1," in warning, warning
    assert "--threads" in warning and "one worker per machine" in warning, warning

    third = cluster.worker(router, name="third", threads=cores)
    router.wait_workers(3)
    third_argv = _llama_server(third).cmdline()
    assert _flag(third_argv, "--threads") == str(cores), third_argv
    [warning] = _warnings(third)
    assert f"this llama-server {cores} (--threads)" in warning, warning


def test_a_worker_given_a_truncated_model_exits_saying_what_to_do(
    cluster: Cluster, model_path: Path, tmp_path: Path
) -> None:
    whole = model_path.stat().st_size
    half = tmp_path / "half.gguf"
    with model_path.open("rb") as f:
        half.write_bytes(f.read(whole // 2))
    router = cluster.router()
    worker = cluster.worker(
        router,
        *("--llama-server-path", str(cluster.llama_server)),
        *("--model", str(half), "--model-alias", MODEL),
        model=False,
    )
    code = worker.wait(TRUNCATED_EXIT_S)
    log = worker.log()
    assert code != 0, log
    expected = f"{half} is truncated: {whole // 2} of {whole} bytes; delete it and pull again."
    assert expected in log, log
    assert "Traceback" not in log, log
    assert "starting " not in log, log  # no llama-server was started
