"""How many cores this process may really compute on: the machine's, less what its CPU
affinity and its cgroup's CPU quota (a container's ``--cpus``) leave it.

``usable_cores`` is the rule (a pure function); ``detect_usable_cores`` reads the facts where
the system shows them (``sched_getaffinity``; cgroup v2 ``cpu.max`` of this process's cgroup,
else cgroup v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``) and treats what it cannot read as
no limit.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from shoal.hardware.profile import CpuInfo

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def usable_cores(cpu: CpuInfo, affinity: int | None, quota: float | None) -> int:
    """Cores a CPU-bound process can keep busy here: physical cores (llama.cpp's own default:
    a second hardware thread on a core adds little to its matrix work), at most the CPUs it
    may run on (``affinity``) and the whole cores its cgroup's quota pays for; at least 1."""
    cores = cpu.physical_cores or cpu.logical_cores
    if affinity:
        cores = min(cores, affinity)
    if quota is not None:
        cores = min(cores, math.floor(quota))
    return max(1, cores)


def parse_cpu_max(text: str) -> float | None:
    """Cores a cgroup v2 ``cpu.max`` (``"QUOTA PERIOD"`` or ``"max PERIOD"``) allows; None for
    no limit or text that is not that."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    return _ratio(parts[0], parts[1])


def parse_cfs(quota: str, period: str) -> float | None:
    """Cores a cgroup v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` allows; None for no
    limit (a quota of -1) or text that is not a number."""
    return _ratio(quota.strip(), period.strip())


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def detect_usable_cores(cpu: CpuInfo) -> int:
    """``usable_cores`` for this process, from what the system shows. Blocking (small reads)."""
    return usable_cores(cpu, _affinity(), cgroup_cpu_limit())


def _affinity() -> int | None:
    getaffinity = getattr(os, "sched_getaffinity", None)  # Linux only
    return len(getaffinity(0)) if getaffinity is not None else None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """Cores this process's cgroup may use (the tightest quota of it and its ancestors), or
    None when there is no limit or none is shown."""
    v2 = [parse_cpu_max(text) for text in _v2_texts(root, proc_cgroup)]
    limits = [limit for limit in v2 if limit is not None]
    quota, period = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu/cpu.cfs_period_us")
    if quota is not None and period is not None:
        v1 = parse_cfs(quota, period)
        limits += [v1] if v1 is not None else []
    return min(limits, default=None)


def _v2_texts(root: Path, proc_cgroup: Path) -> list[str]:
    """``cpu.max`` of this process's cgroup v2 (``0::/PATH`` in ``/proc/self/cgroup``) and of
    each of its ancestors (inside a container, the root is the container's own)."""
    path = ""
    for line in (_read(proc_cgroup) or "").splitlines():
        if line.startswith("0::"):
            path = line[3:].strip().strip("/")
    folder, texts = root / path, []
    while True:
        text = _read(folder / "cpu.max")
        if text is not None:
            texts.append(text)
        if folder == root or root not in folder.parents:
            return texts
        folder = folder.parent


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
