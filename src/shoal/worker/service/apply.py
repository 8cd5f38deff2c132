"""Carrying out an :class:`InstallPlan`: files written atomically, commands through a runner."""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shlex
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shoal.worker.service.plan import InstallPlan, MakeDir, RemoveFile, RunCommand, WriteFile
from shoal.worker.service.units import ServiceError

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 120.0
"""systemctl restart waits for the old worker to stop (TimeoutStopSec) and the new to start."""


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str = ""
    stderr: str = ""


class Runner(Protocol):
    def __call__(self, argv: Sequence[str]) -> Completed: ...


def run_command(argv: Sequence[str]) -> Completed:
    """The real runner: the command's output is captured for error messages."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        raise ServiceError(f"{argv[0]} is not installed or not on PATH") from None
    except subprocess.TimeoutExpired:
        raise ServiceError(
            f"`{shlex.join(argv)}` did not finish within {COMMAND_TIMEOUT_S:g} s"
        ) from None
    return Completed(done.returncode, done.stdout, done.stderr)


def apply(plan: InstallPlan, runner: Runner = run_command, *, euid: int | None = None) -> None:
    """Check the preconditions, then carry out every step in order.

    ``euid`` defaults to this process's; a system service needs root.
    """
    _check_root(plan, os.geteuid() if euid is None else euid)
    if plan.must_exist is not None and not plan.host_path(plan.must_exist).exists():
        raise ServiceError(
            f"no worker service named {plan.name!r} is installed here "
            f"({plan.must_exist} does not exist){_installed_hint(plan)}"
        )
    owner_ids = _owner_ids(plan.service_user)
    log.info("service %s: %s", plan.name, plan.summary)
    for step in plan.steps:
        if isinstance(step, MakeDir):
            _make_dir(plan.host_path(step.path), step.mode, owner_ids if step.owner else None)
        elif isinstance(step, WriteFile):
            ids = owner_ids if step.owner else None
            _write_atomic(plan.host_path(step.path), step.content, step.mode, ids)
        elif isinstance(step, RemoveFile):
            plan.host_path(step.path).unlink(missing_ok=True)
            log.info("service %s: removed %s", plan.name, step.path)
        else:
            _run(step, runner, plan.name)


def _check_root(plan: InstallPlan, euid: int) -> None:
    if not plan.needs_root or euid == 0:
        return
    if plan.action == "install":
        raise ServiceError(
            "installing a system service needs root: run it with sudo, or pass --user to "
            "install a service that runs as you (started at boot only with lingering enabled)"
        )
    raise ServiceError(
        "removing a system service needs root: run it with sudo (or pass --user if you "
        "installed it with --user)"
    )


def _installed_hint(plan: InstallPlan) -> str:
    """Unit files are ``<prefix><name><suffix>``: list the names installed beside it."""
    assert plan.must_exist is not None
    folder = plan.host_path(plan.must_exist).parent
    suffix = plan.must_exist.suffix
    prefix = plan.must_exist.name[: -len(plan.name + suffix)]
    names = sorted(p.name[len(prefix) : -len(suffix)] for p in folder.glob(f"{prefix}*{suffix}"))
    if names:
        return f"; installed there: {', '.join(names)}"
    return "; for a service installed with --user, pass --user"


def _owner_ids(user: str | None) -> tuple[int, int] | None:
    if user is None:
        return None
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ServiceError(
            f"user {user!r} does not exist: create it first (for example `useradd --system "
            f"--create-home {user}`), or leave out the service user to run as root"
        ) from None
    return entry.pw_uid, entry.pw_gid


def _make_dir(path: Path, mode: int, owner: tuple[int, int] | None) -> None:
    if path.is_dir():
        return
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)  # mkdir's mode is cut by the umask
    if owner is not None:
        os.chown(path, *owner)
    log.info("created %s (mode %04o)", path, mode)


def _write_atomic(path: Path, content: bytes, mode: int, owner: tuple[int, int] | None) -> None:
    """Temp file in the same folder (mkstemp makes it 0600), mode and owner set, then renamed
    over ``path``: readers see the old file or the new one, and a secret is never readable
    by anyone else, not even for a moment."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), mode)
            if owner is not None:
                os.fchown(f.fileno(), *owner)
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    log.info("wrote %s (mode %04o)", path, mode)


def _run(step: RunCommand, runner: Runner, name: str) -> None:
    shown = shlex.join(step.argv)
    log.info("service %s: running %s", name, shown)
    done = runner(step.argv)
    if done.returncode == 0:
        return
    detail = (done.stderr or done.stdout).strip() or "no output"
    if step.check:
        raise ServiceError(f"`{shown}` failed (exit {done.returncode}): {detail}")
    log.warning("service %s: `%s` failed (exit %d): %s", name, shown, done.returncode, detail)
