"""The worker as a system service: systemd units on Linux, launchd jobs on macOS."""

from shoal.worker.service.apply import Completed, Runner, apply, run_command
from shoal.worker.service.install import (
    InstallOptions,
    installed_names,
    plan_install,
    plan_uninstall,
)
from shoal.worker.service.plan import InstallPlan, describe
from shoal.worker.service.units import ServiceError, ServiceSpec, launchd_plist, systemd_unit

__all__ = [
    "Completed",
    "InstallOptions",
    "InstallPlan",
    "Runner",
    "ServiceError",
    "ServiceSpec",
    "apply",
    "describe",
    "installed_names",
    "launchd_plist",
    "plan_install",
    "plan_uninstall",
    "run_command",
    "systemd_unit",
]
