"""What a worker service looks like to systemd and launchd: pure rendering, no I/O.

A :class:`ServiceSpec` says what to run and as whom; :func:`systemd_unit` and
:func:`launchd_plist` turn it into the file the service manager reads. Secrets never
appear in either file: they live in ``spec.env_file`` (mode 0600), which systemd reads
through ``EnvironmentFile=`` and launchd through a ``/bin/sh`` wrapper (launchd has no
equivalent of ``EnvironmentFile=``, and a plist is world-readable).
"""

from __future__ import annotations

import plistlib
import re
from dataclasses import dataclass
from pathlib import Path

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
USER_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")

STOP_TIMEOUT_S = 30
"""How long a stopping worker gets before SIGKILL: it stops llama-server itself (SIGTERM,
``llama_server.STOP_GRACE_S``, SIGKILL) and closes its router link; 30 s leaves room."""
RESTART_DELAY_S = 10
"""Pause before restarting a crashed worker (systemd RestartSec, launchd ThrottleInterval)."""

LAUNCHD_WRAPPER = 'set -a && . "$1" && set +a && shift && exec "$@"'
"""``sh -c`` script for launchd: export every assignment in the env file ($1), then exec
the worker (the remaining arguments). The env file uses double-quoted values, which POSIX sh
and systemd's EnvironmentFile parser read the same way."""


class ServiceError(Exception):
    """A service cannot be installed or removed as asked; the message says what to do."""


def validate_name(name: str) -> str:
    """Service names become file names and unit names: letters, digits, ``-``, ``_``, ``.``."""
    if not NAME_PATTERN.fullmatch(name) or name in {".", ".."}:
        raise ServiceError(
            f"invalid service name {name!r}: use 1 to 64 letters, digits, '-', '_' or '.' "
            "(for example --name qwen)"
        )
    return name


def validate_user(user: str) -> str:
    if not USER_PATTERN.fullmatch(user):
        raise ServiceError(
            f"invalid user name {user!r}: a user name starts with a letter or '_' and has "
            "only letters, digits, '-', '_' or '.'"
        )
    return user


@dataclass(frozen=True)
class ServiceSpec:
    """One worker service: its name, command line, secrets file and who runs it."""

    name: str
    exec_args: tuple[str, ...]
    """The full command line, starting with the absolute path of the program."""
    env_file: Path
    user: str | None = None
    """Run as this user (system services only); None runs as root (or as you, with --user)."""
    user_mode: bool = False
    """A per-user service (systemd --user, a launchd agent) instead of a system one."""
    working_dir: Path | None = None
    stdout_log: Path | None = None
    stderr_log: Path | None = None
    """Where launchd sends output; systemd services log to the journal."""
    writable_paths: tuple[Path, ...] = ()
    """Kept writable in a system service even under /usr, /etc or /boot, which
    ProtectSystem=full makes read-only: an explicit --cache-dir, say."""
    nvidia_modprobe: Path | None = None
    """nvidia-modprobe, run with root rights before a system service starts as ``user``."""

    def __post_init__(self) -> None:
        validate_name(self.name)
        if self.user is not None:
            validate_user(self.user)
            if self.user_mode:
                raise ServiceError("a --user service always runs as you; drop the service user")
        if not self.exec_args or not Path(self.exec_args[0]).is_absolute():
            raise ServiceError(f"the service's program must be an absolute path: {self.exec_args}")

    @property
    def unit_name(self) -> str:
        return f"shoal-worker-{self.name}.service"

    @property
    def label(self) -> str:
        return f"dev.shoal.worker.{self.name}"

    @property
    def description(self) -> str:
        return f"Shoal worker {self.name}"


_PATH_FORBIDDEN = re.compile(r"[\"'\\\x00-\x1f\x7f]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_C_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def systemd_path(path: str) -> str:
    """A path in a unit file (the program of an Exec line, EnvironmentFile=, ...). systemd
    expands ``%`` specifiers in paths but not ``$`` variables, and refuses quotes,
    backslashes and control characters in them outright."""
    if _PATH_FORBIDDEN.search(path):
        raise ServiceError(
            f"systemd cannot use a path with quotes, backslashes or control characters: "
            f"{path!r}. Use plain paths (for example install shoal in a virtualenv under "
            "/opt/shoal and run the install from there)."
        )
    return path.replace("%", "%%")


def systemd_quote_path(path: str) -> str:
    """A path as one word of a space-separated list (Exec lines, ReadWritePaths=)."""
    escaped = systemd_path(path)
    return f'"{escaped}"' if any(c.isspace() or c == ";" for c in path) else escaped


def systemd_quote_arg(arg: str) -> str:
    """One argument of an Exec line, so systemd hands the program exactly ``arg``.

    systemd splits on whitespace, honours quotes and C escapes, expands ``%`` specifiers and
    ``$VAR`` (``%%`` and ``$$`` are the literal characters), and takes a lone ``;`` as a
    command separator (``\\;`` is the literal).
    """
    if arg == ";":
        return "\\;"
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"')
    escaped = _CONTROL.sub(lambda m: _C_ESCAPES.get(m[0], f"\\x{ord(m[0]):02x}"), escaped)
    escaped = escaped.replace("%", "%%").replace("$", "$$")
    if not arg or escaped != arg or any(c.isspace() or c == "'" for c in arg):
        return f'"{escaped}"'
    return arg


def systemd_command(argv: tuple[str, ...], prefix: str = "") -> str:
    return " ".join(
        [prefix + systemd_quote_path(argv[0]), *(systemd_quote_arg(a) for a in argv[1:])]
    )


def _hardening(spec: ServiceSpec) -> list[str]:
    """Sandboxing that leaves GPUs and the cache alone. None of it for --user services: there
    it needs unprivileged user namespaces, and NoNewPrivileges would stop CUDA's setuid
    nvidia-modprobe, which a user manager cannot run with root rights instead."""
    if spec.user_mode:
        return []
    lines = [
        # Neither the worker nor llama-server needs setuid programs; nvidia-modprobe, which
        # CUDA runs to load nvidia-uvm, gets root rights from the ExecStartPre= below.
        "NoNewPrivileges=yes",
        # A private /tmp: the worker shares nothing through it.
        "PrivateTmp=yes",
        # /usr, /boot and /etc read-only. Not PrivateDevices= (it would hide /dev/nvidia*,
        # /dev/dri, /dev/kfd) and not ProtectHome= (the cache and models live in a home).
        "ProtectSystem=full",
    ]
    # "-": a path that does not exist yet is no error.
    lines += [f"ReadWritePaths={systemd_quote_path('-' + str(p))}" for p in spec.writable_paths]
    return lines


def systemd_unit(spec: ServiceSpec) -> str:
    """The ``.service`` file: started at boot, restarted on failure, stopped with its children."""
    wanted_by = "default.target" if spec.user_mode else "multi-user.target"
    unit = [
        f"# Written by `shoal worker install`; remove with `shoal worker uninstall --name "
        f"{spec.name}`.",
        f"# Secrets are in {spec.env_file}, not here.",
        "[Unit]",
        f"Description={spec.description}",
    ]
    if not spec.user_mode:
        # A user manager has no network-online.target; the worker redials with backoff anyway.
        unit += ["After=network-online.target", "Wants=network-online.target"]
    service = ["", "[Service]", "Type=simple"]
    if spec.user is not None:
        service.append(f"User={spec.user}")
    service.append(f"EnvironmentFile={systemd_path(str(spec.env_file))}")
    if spec.working_dir is not None:
        service.append(f"WorkingDirectory={systemd_path(str(spec.working_dir))}")
    if spec.nvidia_modprobe is not None and spec.user is not None and not spec.user_mode:
        # "-": a machine without NVIDIA GPUs is fine; "+": as root despite User=.
        modprobe = (str(spec.nvidia_modprobe), "-u", "-c=0")
        service.append(f"ExecStartPre={systemd_command(modprobe, prefix='-+')}")
    service += [
        f"ExecStart={systemd_command(spec.exec_args)}",
        "Restart=on-failure",
        f"RestartSec={RESTART_DELAY_S}",
        # SIGTERM to the worker only: it stops llama-server itself, in order. Whatever is
        # left in the control group when the worker has exited gets SIGKILL.
        "KillMode=mixed",
        f"TimeoutStopSec={STOP_TIMEOUT_S}",
        *_hardening(spec),
    ]
    install = ["", "[Install]", f"WantedBy={wanted_by}"]
    return "\n".join(unit + service + install) + "\n"


def launchd_arguments(spec: ServiceSpec) -> list[str]:
    """``sh -c WRAPPER <name> <env file> <program> <args>...``: $0 names the job in errors."""
    return ["/bin/sh", "-c", LAUNCHD_WRAPPER, spec.label, str(spec.env_file), *spec.exec_args]


def launchd_plist(spec: ServiceSpec) -> bytes:
    """The launchd job: a LaunchDaemon (system) or a LaunchAgent (``user_mode``)."""
    job: dict[str, object] = {
        "Label": spec.label,
        "ProgramArguments": launchd_arguments(spec),
        "RunAtLoad": True,
        # Restart when it fails; a clean exit (a stop) stays stopped.
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_DELAY_S,
        "ExitTimeOut": STOP_TIMEOUT_S,
        # Left at its default (false): when the worker exits, launchd kills what remains of
        # its process group, llama-server included.
        "AbandonProcessGroup": False,
    }
    if spec.user is not None:
        job["UserName"] = spec.user
    if spec.working_dir is not None:
        job["WorkingDirectory"] = str(spec.working_dir)
    if spec.stdout_log is not None:
        job["StandardOutPath"] = str(spec.stdout_log)
    if spec.stderr_log is not None:
        job["StandardErrorPath"] = str(spec.stderr_log)
    try:
        return plistlib.dumps(job, fmt=plistlib.FMT_XML, sort_keys=True)
    except ValueError as exc:  # XML has no room for most control characters
        raise ServiceError(f"cannot write a launchd plist for these arguments: {exc}") from None
