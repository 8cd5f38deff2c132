"""``shoal doctor`` through the real CLI: on this machine, and with a recorded driver.

The second machine is this one with a FAKE ``nvidia-smi`` first on PATH
(``fakes.tool_replay.nvidia_h100_driver``: recorded outputs of H100 machines). NVML cannot
load here (no driver library), so the detection falls back to that ``nvidia-smi``, as it
does on a machine whose NVML is broken.
The llama-server is Shoal's real cached CPU build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cluster import clean_env
from fakes.tool_replay import nvidia_h100_driver
from shoal.cli.doctor_checks import binary_check, model_check
from shoal.hardware import nvidia
from shoal.hardware.profile import Accelerator, GpuDevice
from shoal.llama_cpp.backend import BackendChoice
from shoal.llama_cpp.binaries import Binaries, cached_build
from shoal.llama_cpp.devices import ComputeDevice
from shoal.settings import CommonSettings

SYSTEM_PATH = os.pathsep.join(["/usr/bin", "/bin"])
"""Tools the fake needs (sh, cat) and nothing of the developer's (no nvcc)."""


def cpu_build() -> Path:
    found = cached_build(CommonSettings().cache_dir, "cpu")
    if found is None:
        pytest.fail("no cached CPU build of llama.cpp; run the set-up first (scripts/dev.sh)")
    return found.llama_server


def doctor(*args: str, path: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoal", "doctor", *args],
        capture_output=True,
        text=True,
        env=clean_env(PATH=path, **env),
        timeout=120,
        check=False,
    )


def checks(answer: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    body = json.loads(answer.stdout)
    return {c["name"]: c for c in body["checks"]}


def test_on_this_machine_without_a_gpu_it_says_so_and_exits_0() -> None:
    if nvidia.from_nvml():
        pytest.skip("this machine has an NVIDIA GPU (NVML lists one)")
    answer = doctor(path=os.environ["PATH"])
    assert answer.returncode == 0, answer.stdout + answer.stderr
    assert "ok     gpus       no GPU: models run on the CPU" in answer.stdout
    assert "everything checked is in order." in answer.stdout or "no errors" in answer.stdout

    found = checks(doctor("--json", path=os.environ["PATH"]))
    assert list(found) == ["gpus", "backend", "llama.cpp", "model", "router"]
    assert found["backend"]["finding"] == "cpu, chosen for this machine"
    assert found["llama.cpp"]["status"] == "ok"
    assert found["router"]["status"] == "skip"  # no --router-url given


@pytest.mark.parametrize("how", ["PATH", "--llama-server-path"])
def test_a_recorded_h100_driver_with_the_cpu_build_says_what_to_run(
    tmp_path: Path, how: str
) -> None:
    """The machine of issue 25 (H100s, driver 580 with CUDA 13.0, no toolkit), running the
    CPU build: an error, naming the fix, and a non-zero exit status."""
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "llama-server").symlink_to(cpu_build())
    driver = nvidia_h100_driver().on_path(tmp_path / "driver")
    path = os.pathsep.join([str(driver), str(folder), SYSTEM_PATH])
    flags = ("--llama-server-path", str(cpu_build())) if how != "PATH" else ()

    answer = doctor(*flags, path=path)

    assert answer.returncode == 1, answer.stdout + answer.stderr
    assert "8x NVIDIA H100 80GB HBM3; NVIDIA driver" in answer.stdout
    assert "is a CPU build: it drives none of the GPUs here" in answer.stdout
    found = checks(doctor("--json", *flags, path=path))
    assert found["gpus"]["finding"].endswith("the driver supports CUDA 13.0")
    assert found["backend"]["status"] == "ok"
    assert "release: llama-b11434-bin-ubuntu-cuda-12.8-x64.tar.gz" in "\n".join(
        found["backend"]["details"]
    )
    assert found["llama.cpp"]["status"] == "error"
    assert "shoal llama-cpp install" in found["llama.cpp"]["fix"]
    if how != "PATH":
        assert "--llama-server-path" in found["llama.cpp"]["fix"]
    assert "runs on the CPU here" in found["model"]["fix"]


def test_a_worker_told_to_use_no_gpu_may_run_the_cpu_build(tmp_path: Path) -> None:
    """``--gpu-devices none``, as the worker reads it: the CPU build is what it asked for;
    a value the worker would refuse is an error here too."""
    driver = nvidia_h100_driver().on_path(tmp_path / "driver")
    path = os.pathsep.join([str(driver), SYSTEM_PATH])
    server = ("--llama-server-path", str(cpu_build()))

    answer = doctor("--json", *server, "--gpu-devices", "none", path=path)
    assert answer.returncode == 0, answer.stdout + answer.stderr
    assert checks(answer)["llama.cpp"]["status"] == "ok"

    wrong = doctor("--json", *server, "--gpu-devices", "0,x", path=path)
    assert wrong.returncode == 1
    assert "'x' is not a GPU index" in checks(wrong)["--gpu-devices"]["finding"]


def test_a_driver_too_old_for_any_build_says_to_upgrade_it(tmp_path: Path) -> None:
    """H100s on driver 535 (CUDA 12.2): no release build runs there and nothing can be
    built, so the backend falls to the CPU, which is an error with the upgrade as its fix."""
    driver = nvidia_h100_driver("nvidia_smi_banner_h100_535.txt").on_path(tmp_path / "driver")
    path = os.pathsep.join([str(driver), SYSTEM_PATH])
    answer = doctor("--json", "--llama-server-path", str(cpu_build()), path=path)
    assert answer.returncode == 1
    found = checks(answer)
    assert found["backend"]["status"] == "error"
    assert "upgrade the NVIDIA driver to one that supports CUDA 12.8" in found["backend"]["fix"]
    assert found["llama.cpp"]["status"] == "error"


# ---------------------------------------------------------------- the checks, pure

H100 = GpuDevice(0, "NVIDIA H100 80GB HBM3", Accelerator.CUDA, 80 << 30)
SERVER = Binaries(Path("/opt/llama-server"), None, "cache", "cached")


def test_a_build_driving_the_gpus_through_another_backend_is_a_warning() -> None:
    vulkan = (ComputeDevice("Vulkan0", "NVIDIA H100 80GB HBM3", 80 << 30, 79 << 30),)
    check = binary_check(SERVER, vulkan, (H100,), BackendChoice("cuda"))
    assert (check.status, check.finding.endswith("drives Vulkan0, not CUDA")) == ("warn", True)
    assert check.fix == "run `shoal llama-cpp install --llama-cpp-backend cuda`"


def test_a_build_driving_some_of_the_gpus_is_a_warning() -> None:
    cuda0 = (ComputeDevice("CUDA0", "NVIDIA H100 80GB HBM3", 80 << 30, 79 << 30),)
    check = binary_check(SERVER, cuda0, (H100, H100), BackendChoice("cuda"))
    assert check.status == "warn" and "1 of 2 GPUs" in check.finding
    assert binary_check(SERVER, cuda0, (H100,), BackendChoice("cuda")).status == "ok"


def test_a_model_that_cannot_be_served_is_an_error() -> None:
    check = model_check("no-such-model", "no quantization of no-such-model fits", False)
    assert check.status == "error" and check.fix == "see `shoal models show no-such-model`"


def test_several_text_models_get_a_check_each(tmp_path: Path) -> None:
    """``--model a,b`` (several models per worker) is two models, not one named "a,b"; so is
    a models file's list, and a models file's mistake is the model check's error."""
    answer = doctor("--json", "--model", "smollm2-135m-instruct,no-such-model", path=SYSTEM_PATH)
    found = [c for c in json.loads(answer.stdout)["checks"] if c["name"] == "model"]
    assert [c["finding"].split()[0] for c in found] == [
        "smollm2-135m-instruct",
        "no-such-model",
    ], found
    listed = tmp_path / "models.toml"
    listed.write_text('[[models]]\nmodel = "smollm2-135m-instruct"\n[[models]]\nmodel = "x"\n')
    answer = doctor("--json", "--models-file", str(listed), path=SYSTEM_PATH)
    found = [c for c in json.loads(answer.stdout)["checks"] if c["name"] == "model"]
    assert [c["finding"].split()[0] for c in found] == ["smollm2-135m-instruct", "x"], found
    listed.write_text('[[models]]\nmodel = "a"\npinnned = true\n')
    answer = doctor("--json", "--models-file", str(listed), path=SYSTEM_PATH)
    found = [c for c in json.loads(answer.stdout)["checks"] if c["name"] == "model"]
    assert found[0]["status"] == "error" and "unknown key(s) pinnned" in found[0]["finding"]
