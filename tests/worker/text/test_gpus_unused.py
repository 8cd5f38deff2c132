"""A worker on a GPU machine with a CPU build of llama-server says so, with the fix.

The machine is a profile with H100s (what ``hardware.detect`` reads from a recorded
``nvidia-smi``, as ``tests/hardware`` checks); the llama-server is Shoal's real cached CPU
build, asked for its devices (``--list-devices``), and the model the real default model.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from shoal.hardware.profile import Accelerator, CpuInfo, GpuDevice, MachineProfile
from shoal.worker.settings import WorkerSettings
from shoal.worker.text.plan import gpus_unused_before_plan, plan

GIB = 1 << 30
H100 = GpuDevice(0, "NVIDIA H100 80GB HBM3", Accelerator.CUDA, 80 * GIB, cuda_version="13.0")


def machine(*gpus: GpuDevice) -> MachineProfile:
    return MachineProfile(
        hostname="h100-box",
        os="Linux",
        cpu=CpuInfo(model="Xeon", logical_cores=16),
        ram_total_bytes=128 * GIB,
        ram_available_bytes=120 * GIB,
        gpus=gpus,
    )


def settings(tmp_path: Path, llama_server: Path, **more: object) -> WorkerSettings:
    return WorkerSettings(
        cache_dir=tmp_path / "cache",
        llama_server_path=llama_server,
        **more,  # type: ignore[arg-type]  # the test's own fields
    )


def test_the_plan_says_the_gpus_sit_idle_and_warns(
    tmp_path: Path, llama_server: Path, model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="shoal.worker")
    the_plan = plan(
        settings(tmp_path, llama_server, model_path=model_path), os.environ["PATH"], machine(H100)
    )
    said = the_plan.gpus_unused
    assert said is not None
    assert "this machine has 1 GPU (NVIDIA H100 80GB HBM3)" in said
    assert "--llama-server-path" in said and "shoal llama-cpp install" in said
    assert said in caplog.text


def test_no_gpu_no_warning(tmp_path: Path, llama_server: Path, model_path: Path) -> None:
    the_plan = plan(
        settings(tmp_path, llama_server, model_path=model_path), os.environ["PATH"], machine()
    )
    assert the_plan.gpus_unused is None


def test_before_the_routers_model_is_known_the_build_at_hand_is_checked(
    tmp_path: Path, llama_server: Path
) -> None:
    said = gpus_unused_before_plan(
        settings(tmp_path, llama_server), os.environ["PATH"], machine(H100, H100)
    )
    assert said is not None and "drives none of them" in said
    attached = settings(tmp_path, llama_server, backend_url="http://127.0.0.1:9")
    assert gpus_unused_before_plan(attached, os.environ["PATH"], machine(H100)) is None


def test_a_worker_told_to_use_no_gpu_runs_on_the_cpu_without_a_warning(
    tmp_path: Path, llama_server: Path, model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``--gpu-devices none`` (a CPU stage beside a GPU worker on one machine, say): its
    llama-server gets ``--device none``, and no GPU is said to sit idle: it was asked to."""
    caplog.set_level(logging.WARNING, logger="shoal.worker")
    cpu_only = settings(tmp_path, llama_server, model_path=model_path, gpu_devices="none")
    the_plan = plan(cpu_only, os.environ["PATH"], machine(H100))
    assert the_plan.gpus_unused is None and "drives none" not in caplog.text
    assert the_plan.llama is not None
    assert the_plan.llama.device_args == ("--device", "none")
    assert gpus_unused_before_plan(cpu_only, os.environ["PATH"], machine(H100)) is None
