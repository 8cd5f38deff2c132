"""The cores a process may compute on: physical cores, CPU affinity and cgroup quotas."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.hardware.cpu_quota import (
    cgroup_cpu_limit,
    detect_usable_cores,
    parse_cfs,
    parse_cpu_max,
    usable_cores,
)
from shoal.hardware.profile import CpuInfo

HT = CpuInfo(model="x", logical_cores=16, physical_cores=8)


@pytest.mark.parametrize(
    ("cpu", "affinity", "quota", "cores"),
    [
        (HT, None, None, 8),  # a second hardware thread per core is not counted
        (CpuInfo(model="x", logical_cores=4), None, None, 4),  # physical cores unknown
        (HT, 4, None, 4),  # taskset -c 0-3
        (HT, 12, None, 8),
        (HT, None, 2.0, 2),  # docker --cpus 2
        (HT, None, 1.5, 1),  # only whole cores are paid for
        (HT, None, 0.5, 1),  # at least one
        (HT, 3, 2.5, 2),
        (CpuInfo(model="x", logical_cores=0, physical_cores=0), None, None, 1),
    ],
)
def test_usable_cores(cpu: CpuInfo, affinity: int | None, quota: float | None, cores: int) -> None:
    assert usable_cores(cpu, affinity, quota) == cores


@pytest.mark.parametrize(
    ("text", "cores"),
    [
        ("max 100000\n", None),
        ("200000 100000\n", 2.0),
        ("150000 100000", 1.5),
        ("", None),
        ("garbage", None),
        ("x 100000", None),
    ],
)
def test_cgroup_v2_cpu_max(text: str, cores: float | None) -> None:
    assert parse_cpu_max(text) == cores


@pytest.mark.parametrize(
    ("quota", "period", "cores"),
    [("-1\n", "100000\n", None), ("50000", "100000", 0.5), ("400000", "100000", 4.0)],
)
def test_cgroup_v1_cfs(quota: str, period: str, cores: float | None) -> None:
    assert parse_cfs(quota, period) == cores


def test_the_tightest_quota_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/worker.service\n")
    root = tmp_path / "fs"
    (root / "system.slice" / "worker.service").mkdir(parents=True)
    (root / "system.slice" / "worker.service" / "cpu.max").write_text("max 100000\n")
    (root / "system.slice" / "cpu.max").write_text("300000 100000\n")
    assert cgroup_cpu_limit(root, proc) == 3.0
    (root / "cpu.max").write_text("200000 100000\n")
    assert cgroup_cpu_limit(root, proc) == 2.0


def test_cgroup_v1_and_nothing_shown(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/x\n1:cpu:/\n")
    root = tmp_path / "fs"
    assert cgroup_cpu_limit(root, proc) is None
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(root, proc) == 1.5
    assert cgroup_cpu_limit(root, tmp_path / "no-such-file") == 1.5


def test_this_machine_has_at_least_one_usable_core() -> None:
    cpu = CpuInfo(model="x", logical_cores=2, physical_cores=2)
    assert 1 <= detect_usable_cores(cpu) <= 2
