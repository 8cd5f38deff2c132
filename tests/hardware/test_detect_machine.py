"""detect_machine and refresh_free_memory with a runner that replays recorded tool outputs.

``Replay`` (``fakes.tool_replay``) is a FAKE of the vendor tools: it answers each command line
with a recorded output from ``fixtures/`` and treats every other command as not installed, as
``run_tool`` does for a missing binary. ``run_tool`` itself is tested against real processes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from fakes.tool_replay import Replay, nvidia_h100_driver
from shoal.hardware import amd, apple, detect, nvidia, vulkan
from shoal.hardware.detect import ToolResult, detect_machine, refresh_free_memory, run_tool
from shoal.hardware.profile import Accelerator, GpuDevice, MachineProfile

FIXTURES = Path(__file__).parent / "fixtures"
MIB = 1 << 20


def read(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def no_nvml() -> list[GpuDevice] | None:
    return None


def test_nvidia_smi_is_asked_when_nvml_is_missing() -> None:
    run = Replay({nvidia.smi_command(): read("nvidia_smi_v100x8.csv")})
    profile = detect_machine(run, system="Linux", nvml=no_nvml)
    assert profile.accelerator is Accelerator.CUDA
    assert len(profile.gpus) == 8
    assert profile.gpus[6].memory_free_bytes == (32768 - 13928) * MIB
    # found: its banner is read for the CUDA version; AMD and Vulkan are not asked
    assert run.calls == [nvidia.smi_command(), nvidia.SMI_BANNER]
    assert profile.gpus[0].cuda_version == ""  # no banner recorded for this machine


@pytest.mark.parametrize(
    ("banner", "cuda_version"),
    [
        ("nvidia_smi_banner_h100_535.txt", "12.2"),
        ("nvidia_smi_banner_a100x2_580.txt", "13.0"),
        ("nvidia_smi_banner_b200_r610.txt", "13.3"),  # R610: "CUDA UMD Version"
    ],
)
def test_the_banner_gives_every_gpu_the_drivers_cuda_version(
    banner: str, cuda_version: str
) -> None:
    """Query and banner from different machines (see fixtures/SOURCES.md): only the CUDA
    version is read from the banner."""
    run = Replay(
        {
            nvidia.smi_command(): read("nvidia_smi_compute_cap_h100x8.csv"),
            nvidia.SMI_BANNER: read(banner),
        }
    )
    profile = detect_machine(run, system="Linux", nvml=no_nvml)
    assert {(g.compute_capability, g.cuda_version) for g in profile.gpus} == {("9.0", cuda_version)}


def test_nvml_wins_without_running_any_tool() -> None:
    gpu = GpuDevice(0, "NVIDIA A10", Accelerator.CUDA, 24 << 30, 20 << 30)
    run = Replay({})
    profile = detect_machine(run, system="Linux", nvml=lambda: [gpu])
    assert profile.gpus == (gpu,)
    assert run.calls == []


def test_an_old_driver_is_asked_again_without_compute_cap() -> None:
    rejected = ToolResult(2, read("nvidia_smi_no_compute_cap.txt"))
    legacy = nvidia.smi_command(nvidia.SMI_FIELDS_LEGACY)
    run = Replay({nvidia.smi_command(): rejected, legacy: read("nvidia_smi_v100x8.csv")})
    profile = detect_machine(run, system="Linux", nvml=no_nvml)
    assert len(profile.gpus) == 8
    assert run.calls == [nvidia.smi_command(), legacy, nvidia.SMI_BANNER]


def test_amd_smi_static_and_metric() -> None:
    run = Replay(
        {
            amd.AMD_SMI_STATIC: read("amd_smi_static_list_rx6600.json"),
            amd.AMD_SMI_METRIC: read("amd_smi_metric_list_rx6600.json"),
        }
    )
    profile = detect_machine(run, system="Linux", nvml=no_nvml)
    assert profile.accelerator is Accelerator.ROCM
    assert [(g.name, g.memory_total_bytes, g.memory_free_bytes) for g in profile.gpus] == [
        ("Navi 23 [Radeon RX 6600/6600 XT", 8176 * MIB, 7974 * MIB)
    ]


def test_rocm_smi_when_amd_smi_is_missing() -> None:
    run = Replay({amd.ROCM_SMI: read("rocm_smi_mi250_2card.json")})
    profile = detect_machine(run, system="Linux", nvml=no_nvml)
    assert [g.index for g in profile.gpus] == [0, 1]
    assert profile.accelerator is Accelerator.ROCM
    assert amd.AMD_SMI_STATIC in run.calls


def test_apple_silicon_on_darwin() -> None:
    run = Replay(
        {
            apple.SYSCTL: read("sysctl_darwin_m3max.txt"),
            apple.SYSTEM_PROFILER: read("system_profiler_displays_m3max.json"),
            apple.SYSCTL_WIRED_LIMIT: ToolResult(1, "", "sysctl: unknown oid"),
        }
    )
    profile = detect_machine(run, system="Darwin", nvml=no_nvml)
    assert profile.accelerator is Accelerator.METAL
    assert profile.gpus[0].name == "Apple M3 Max (40-core GPU)"
    assert profile.gpus[0].memory_total_bytes == 24 << 30
    assert profile.cpu.model == "Apple M3 Max"
    assert "dotprod" in profile.cpu.features
    assert vulkan.VULKANINFO_SUMMARY not in run.calls


def test_apple_is_not_asked_on_linux() -> None:
    run = Replay({apple.SYSTEM_PROFILER: read("system_profiler_displays_m3max.json")})
    profile = detect_machine(run, system="Linux", nvml=no_nvml)
    assert profile.gpus == ()
    assert apple.SYSTEM_PROFILER not in run.calls


def test_vulkan_is_the_last_resort() -> None:
    run = Replay({vulkan.VULKANINFO_SUMMARY: read("vulkaninfo_summary_rtx4080_llvmpipe.txt")})
    profile = detect_machine(run, system="Linux", nvml=no_nvml)
    assert [(g.name, g.accelerator) for g in profile.gpus] == [
        ("NVIDIA GeForce RTX 4080", Accelerator.VULKAN)
    ]
    assert run.calls[-2:] == [vulkan.VULKANINFO_SUMMARY, vulkan.VULKANINFO_FULL]


def test_no_tools_means_cpu_only_from_this_machines_cpu() -> None:
    run = Replay({})
    profile = detect_machine(run, nvml=no_nvml)
    assert profile.gpus == ()
    assert profile.accelerator is Accelerator.CPU
    assert profile.cpu.logical_cores == psutil.cpu_count()
    assert profile.cpu.model
    assert profile.ram_total_bytes == psutil.virtual_memory().total
    assert 0 < profile.ram_available_bytes <= profile.ram_total_bytes
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and " avx2 " in cpuinfo.read_text() + " ":
        assert "avx2" in profile.cpu.features
    assert run.calls  # every tool was tried


def test_failing_tools_are_skipped() -> None:
    broken = ToolResult(1, "", "Segmentation fault")
    run = Replay({nvidia.smi_command(): broken, amd.AMD_SMI_STATIC: broken})
    assert detect_machine(run, system="Linux", nvml=no_nvml).gpus == ()


# ------------------------------------------------------------------------ run_tool


def test_run_tool_missing_binary() -> None:
    assert run_tool(("shoal-no-such-tool-xyz", "--version")) is None


def test_run_tool_reports_exit_code_and_output() -> None:
    result = run_tool(("sh", "-c", "echo hello; echo oops >&2; exit 3"))
    assert result == ToolResult(3, "hello\n", "oops\n")
    assert not result.ok


def test_run_tool_gives_up_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(detect, "TOOL_TIMEOUT_S", 0.3)
    started = time.monotonic()
    assert run_tool(("sleep", "10")) is None
    assert time.monotonic() - started < 5


# ---------------------------------------------------------------------- free memory


def cuda_profile() -> MachineProfile:
    run = Replay({nvidia.smi_command(): read("nvidia_smi_v100x8.csv")})
    return detect_machine(run, system="Linux", nvml=no_nvml)


def test_refresh_uses_nvml_when_it_answers() -> None:
    profile = cuda_profile()
    fresh = refresh_free_memory(profile, Replay({}), nvml_free=lambda: {0: 1 << 30})
    assert fresh.gpus[0].memory_free_bytes == 1 << 30
    assert fresh.gpus[6].memory_free_bytes == profile.gpus[6].memory_free_bytes  # kept
    assert fresh.gpus[0].memory_total_bytes == profile.gpus[0].memory_total_bytes


def test_refresh_takes_measured_free_memory_when_it_covers_every_gpu() -> None:
    def no_call() -> dict[int, int] | None:
        raise AssertionError("NVML asked again for what telemetry just read")

    profile = cuda_profile()
    measured = {g.index: (g.index + 1) * MIB for g in profile.gpus}
    run = Replay({})
    fresh = refresh_free_memory(profile, run, nvml_free=no_call, measured=measured)
    assert [g.memory_free_bytes for g in fresh.gpus] == [(i + 1) * MIB for i in range(8)]
    assert run.calls == []
    # Telemetry that misses a GPU: the tools are asked, as without it.
    partial = {0: 1}
    fresh = refresh_free_memory(profile, run, nvml_free=lambda: {0: 5}, measured=partial)
    assert fresh.gpus[0].memory_free_bytes == 5


def test_refresh_falls_back_to_nvidia_smi() -> None:
    command = nvidia.smi_command(nvidia.SMI_FREE_FIELDS)
    # Header and rows in the form nvidia-smi prints for this query (constructed values).
    run = Replay({command: "index, memory.free [MiB]\n0, 100\n6, 200\n"})
    fresh = refresh_free_memory(cuda_profile(), run, nvml_free=lambda: None)
    assert fresh.gpus[0].memory_free_bytes == 100 * MIB
    assert fresh.gpus[6].memory_free_bytes == 200 * MIB
    assert run.calls == [command]


def test_refresh_rocm_from_amd_smi_metric() -> None:
    run = Replay({amd.ROCM_SMI: read("rocm_smi_mi250_2card.json")})
    profile = detect_machine(run, system="Linux", nvml=no_nvml)
    metric = Replay({amd.AMD_SMI_METRIC: read("amd_smi_metric_gpu_data_2gpu.json")})
    fresh = refresh_free_memory(profile, metric)
    assert [g.memory_free_bytes for g in fresh.gpus] == [10126 * MIB, 32567 * MIB]


def test_refresh_metal_follows_available_ram() -> None:
    gpu = GpuDevice(0, "Apple M3 Max", Accelerator.METAL, 1 << 50, None, unified_memory=True)
    profile = MachineProfile("mac", "Darwin", detect_machine(Replay({})).cpu, 1, 1, (gpu,))
    fresh = refresh_free_memory(profile, Replay({}))
    assert fresh.gpus[0].memory_free_bytes == fresh.ram_available_bytes
    assert fresh.ram_available_bytes == pytest.approx(psutil.virtual_memory().available, rel=0.2)


def test_refresh_cpu_only_updates_ram() -> None:
    profile = detect_machine(Replay({}), nvml=no_nvml)
    stale = MachineProfile(profile.hostname, profile.os, profile.cpu, profile.ram_total_bytes, 0)
    assert refresh_free_memory(stale, Replay({})).ram_available_bytes > 0


def test_run_tool_finds_nvidia_smi_in_wsls_driver_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WSL 2 keeps nvidia-smi beside the Windows driver's libcuda, often not on PATH."""
    wsl_lib = tmp_path / "wsl-lib"
    wsl_lib.mkdir()
    tool = wsl_lib / "nvidia-smi"
    tool.write_text("#!/bin/sh\necho 'CUDA Version: 12.6'\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert run_tool(nvidia.SMI_BANNER) is None
    monkeypatch.setattr(detect, "WSL_LIB", wsl_lib)
    result = run_tool(nvidia.SMI_BANNER)
    assert result is not None and result.stdout.strip() == "CUDA Version: 12.6"


def test_the_replay_on_path_answers_as_the_replay_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FAKE nvidia-smi real processes run (``Replay.on_path``) is the same table of
    recordings: detection through the real ``run_tool`` finds what it finds in process, and
    a command line without a recording fails."""
    replay = nvidia_h100_driver()
    folder = replay.on_path(tmp_path / "bin")
    monkeypatch.setenv("PATH", os.pathsep.join([str(folder), "/usr/bin", "/bin"]))
    monkeypatch.setattr(detect, "WSL_LIB", tmp_path / "no-wsl")
    in_process = detect_machine(replay, system="Linux", nvml=no_nvml)
    through_path = detect_machine(run_tool, system="Linux", nvml=no_nvml)
    assert through_path.gpus == in_process.gpus
    assert {(g.name, g.cuda_version) for g in through_path.gpus} == {
        ("NVIDIA H100 80GB HBM3", "13.0")
    }
    assert len(through_path.gpus) == 8
    failed = run_tool(nvidia.smi_command(nvidia.SMI_TELEMETRY_FIELDS))
    assert failed is not None and failed.returncode == 1
    assert "no recording for this command line" in failed.stderr
