"""`shoal worker install`: rendered systemd units and launchd plists, plans, and applying them.

Where this machine has them, the real parsers judge the output: ``systemd-analyze verify``
on every rendered unit, systemd's own ``--test`` dump for how it splits ExecStart, ``/bin/sh``
for the launchd wrapper and its env file, ``plutil -lint`` for plists (macOS only).
"""

from __future__ import annotations

import json
import os
import plistlib
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from pydantic import SecretStr

from shoal.cli.main import build_parser
from shoal.settings import settings_from_args
from shoal.worker.service import (
    Completed,
    InstallOptions,
    ServiceError,
    ServiceSpec,
    apply,
    describe,
    installed_names,
    launchd_plist,
    plan_install,
    plan_uninstall,
    systemd_unit,
)
from shoal.worker.service.arguments import env_file_text, worker_flags
from shoal.worker.service.plan import RunCommand, WriteFile
from shoal.worker.service.units import (
    STOP_TIMEOUT_S,
    launchd_arguments,
    systemd_quote_arg,
    systemd_quote_path,
)
from shoal.worker.settings import WorkerSettings
from shoal.worker.text.llama_server import STOP_GRACE_S

GPU_KEY = "gk-s3cret-$HOME-\"q\"-`x`-\\n-'s'"
BACKEND_KEY = "bk secret with spaces"
HF_TOKEN = "hf_TOKEN%value"
NASTY_ARGS = (
    "plain",
    "two words",
    "100%",
    "%h",
    "$HOME",
    "${X}",
    "$$",
    'dq"q',
    "q'q",
    "bs\\x",
    "tab\there",
    "nl\nx",
    "ctl\x01",
    ";",
    "x;y",
    "",
    " lead",
    "é ü",
    "#c",
    "*",
    "--llama-server-args=--flash-attn on -ngl 99",
)
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
SYSTEMD_BINARY = next(
    (p for p in ("/usr/lib/systemd/systemd", "/lib/systemd/systemd") if os.access(p, os.X_OK)),
    None,
)


class FakeSystemctl:
    """FAKE of systemctl, launchctl and loginctl: there is no service manager running here
    (no systemd as PID 1, no launchd). Records every command line it is given and answers
    with a preset exit status and stderr for the commands named in ``fail``."""

    def __init__(self, fail: dict[str, tuple[int, str]] | None = None) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.fail = fail or {}

    def __call__(self, argv: Sequence[str]) -> Completed:
        self.calls.append(tuple(argv))
        for word, (code, stderr) in self.fail.items():
            if word in argv:
                return Completed(code, "", stderr)
        return Completed(0)


@pytest.fixture(autouse=True)
def _no_shoal_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read SHOAL_* variables; the tests' own must not leak into the flags."""
    for key in list(os.environ):
        if key.startswith("SHOAL_"):
            monkeypatch.delenv(key)


def settings(**given: object) -> WorkerSettings:
    values: dict[str, object] = {"name": "qwen", "router_url": "10.0.0.5:8000"}
    values.update(given)
    return WorkerSettings(**values)  # type: ignore[arg-type]  # test input, validated here


def options(tmp_path: Path, **overrides: object) -> InstallOptions:
    values: dict[str, object] = {
        "root": tmp_path / "root",
        "home": Path("/home/alice"),
        "platform": "linux",
        "uid": 1000,
        "program": (sys.executable, "-m", "shoal"),
        "cwd": Path("/srv/models"),
        "nvidia_modprobe": None,
    }
    values.update(overrides)
    return InstallOptions(**values)  # type: ignore[arg-type]  # test input


def spec(**overrides: object) -> ServiceSpec:
    values: dict[str, object] = {
        "name": "qwen",
        "exec_args": (sys.executable, "-m", "shoal", "worker", "--router-url", "r:8000"),
        "env_file": Path("/etc/shoal/worker-qwen.env"),
    }
    values.update(overrides)
    return ServiceSpec(**values)  # type: ignore[arg-type]  # test input


def unit_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


# --- rendering ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("user_mode", "user", "wanted_by", "has_user_line", "hardened"),
    [
        (False, None, "multi-user.target", False, True),
        (False, "shoal", "multi-user.target", True, True),
        (True, None, "default.target", False, False),
    ],
)
def test_systemd_unit_table(
    user_mode: bool, user: str | None, wanted_by: str, has_user_line: bool, hardened: bool
) -> None:
    lines = unit_lines(systemd_unit(spec(user_mode=user_mode, user=user)))
    assert f"WantedBy={wanted_by}" in lines
    assert ("User=shoal" in lines) is has_user_line
    for line in ("NoNewPrivileges=yes", "PrivateTmp=yes", "ProtectSystem=full"):
        assert (line in lines) is hardened
    assert ("After=network-online.target" in lines) is (not user_mode)
    assert ("Wants=network-online.target" in lines) is (not user_mode)
    for line in (
        "Description=Shoal worker qwen",
        "EnvironmentFile=/etc/shoal/worker-qwen.env",
        f"ExecStart={sys.executable} -m shoal worker --router-url r:8000",
        "Restart=on-failure",
        "KillMode=mixed",
        f"TimeoutStopSec={STOP_TIMEOUT_S}",
    ):
        assert line in lines
    assert not any(
        word in line for line in lines for word in ("PrivateDevices", "ProtectHome", "DeviceAllow")
    ), "the GPU device nodes and the cache in a home folder must stay reachable"


def test_stop_timeout_leaves_room_for_llama_server_to_stop() -> None:
    assert STOP_TIMEOUT_S > STOP_GRACE_S * 2


def test_nvidia_modprobe_runs_as_root_before_a_service_with_a_user() -> None:
    modprobe = Path("/usr/bin/nvidia-modprobe")
    with_user = unit_lines(systemd_unit(spec(user="shoal", nvidia_modprobe=modprobe)))
    assert "ExecStartPre=-+/usr/bin/nvidia-modprobe -u -c=0" in with_user
    as_root = unit_lines(systemd_unit(spec(nvidia_modprobe=modprobe)))
    assert not any(line.startswith("ExecStartPre") for line in as_root)


@pytest.mark.parametrize(
    ("arg", "rendered"),
    [
        ("plain", "plain"),
        ("two words", '"two words"'),
        ("100%", '"100%%"'),
        ("$HOME", '"$$HOME"'),
        ('dq"q', '"dq\\"q"'),
        ("q'q", '"q\'q"'),
        ("bs\\x", '"bs\\\\x"'),
        ("tab\there", '"tab\\there"'),
        ("nl\nx", '"nl\\nx"'),
        ("ctl\x01", '"ctl\\x01"'),
        (";", "\\;"),
        ("", '""'),
    ],
)
def test_systemd_argument_quoting(arg: str, rendered: str) -> None:
    assert systemd_quote_arg(arg) == rendered


@pytest.mark.parametrize(
    ("path", "rendered"),
    [
        ("/opt/shoal/bin/python", "/opt/shoal/bin/python"),
        ("/opt/my env/bin/python", '"/opt/my env/bin/python"'),
        ("/opt/100%/python", "/opt/100%%/python"),
        ("/opt/$x/python", "/opt/$x/python"),  # systemd does not expand $ in the program
    ],
)
def test_systemd_program_path_quoting(path: str, rendered: str) -> None:
    assert systemd_quote_path(path) == rendered


@pytest.mark.parametrize("path", ['/opt/a"b/python', "/opt/a'b/python", "/opt/a\\b/python"])
def test_program_paths_systemd_cannot_run_are_refused(path: str) -> None:
    with pytest.raises(ServiceError, match="plain path"):
        systemd_unit(spec(exec_args=(path, "-m", "shoal")))


@pytest.mark.parametrize("user_mode", [False, True])
def test_launchd_plist(user_mode: bool) -> None:
    log = Path("/Library/Logs/shoal/worker-qwen.log")
    the_spec = spec(
        user=None if user_mode else "shoal",
        user_mode=user_mode,
        stdout_log=log,
        stderr_log=log,
        env_file=Path("/Library/Application Support/shoal/worker-qwen.env"),
    )
    job = plistlib.loads(launchd_plist(the_spec))
    assert job["Label"] == "dev.shoal.worker.qwen"
    assert job["ProgramArguments"] == launchd_arguments(the_spec)
    assert job["ProgramArguments"][-6:] == list(the_spec.exec_args)
    assert job["ProgramArguments"][4] == str(the_spec.env_file)
    assert job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False}
    assert job["StandardOutPath"] == job["StandardErrorPath"] == str(log)
    assert job["ExitTimeOut"] == STOP_TIMEOUT_S
    assert ("UserName" in job) is (not user_mode)
    assert "EnvironmentVariables" not in job, "secrets must not be in the world-readable plist"
    assert plistlib.dumps(job, sort_keys=True) == launchd_plist(the_spec)


def test_plist_refuses_control_characters() -> None:
    with pytest.raises(ServiceError, match="launchd plist"):
        launchd_plist(spec(exec_args=(sys.executable, "ctl\x01")))


@pytest.mark.skipif(shutil.which("plutil") is None, reason="plutil is macOS-only; absent here")
def test_plist_passes_plutil_lint(tmp_path: Path) -> None:
    path = tmp_path / "dev.shoal.worker.qwen.plist"
    path.write_bytes(launchd_plist(spec(stdout_log=tmp_path / "log")))
    subprocess.run(["plutil", "-lint", str(path)], check=True, timeout=30)


# --- the real parsers ----------------------------------------------------------------------


def _verify(unit: Path, *, user_mode: bool, runtime_dir: Path) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    argv = [SYSTEMD_ANALYZE, "verify", "--man=no", *(["--user"] if user_mode else []), str(unit)]
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime_dir)}  # --user needs one
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)


needs_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze not installed (Debian: apt-get install systemd)",
)


@needs_analyze
@pytest.mark.parametrize(
    ("user_mode", "user", "writable"),
    [(False, None, ()), (False, "shoal", ("/var/cache/sho al",)), (True, None, ())],
)
def test_systemd_analyze_verifies_rendered_units(
    tmp_path: Path, user_mode: bool, user: str | None, writable: tuple[str, ...]
) -> None:
    exe_dir = tmp_path / "venv with space 100%"
    exe_dir.mkdir()
    program = exe_dir / "python"
    program.symlink_to(sys.executable)
    the_spec = spec(
        exec_args=(str(program), "-m", "shoal", "worker", *NASTY_ARGS),
        user_mode=user_mode,
        user=user,
        writable_paths=tuple(Path(p) for p in writable),
        nvidia_modprobe=Path("/bin/true"),
        env_file=tmp_path / "env dir/worker-qwen.env",
    )
    unit = tmp_path / the_spec.unit_name
    unit.write_text(systemd_unit(the_spec))
    done = _verify(unit, user_mode=user_mode, runtime_dir=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout


@needs_analyze
def test_systemd_analyze_catches_a_badly_quoted_program(tmp_path: Path) -> None:
    """The check above has teeth: the same program path, unquoted, is refused."""
    exe_dir = tmp_path / "venv with space"
    exe_dir.mkdir()
    (exe_dir / "python").symlink_to(sys.executable)
    unit = tmp_path / "shoal-worker-bad.service"
    unit.write_text(f"[Service]\nExecStart={exe_dir}/python -m shoal\n")
    done = _verify(unit, user_mode=False, runtime_dir=tmp_path)
    assert done.returncode != 0
    assert "not executable" in done.stderr


def _decode_dump_command(line: str) -> list[str]:
    """Split systemd's dumped ``Command Line:`` (double quotes, C escapes, octal bytes)."""
    args: list[str] = []
    i = 0
    while i < len(line):
        if line[i] == " ":
            i += 1
            continue
        word: list[str] = []
        quoted = False
        while i < len(line) and (quoted or line[i] != " "):
            c = line[i]
            if c == '"':
                quoted = not quoted
                i += 1
            elif c == "\\" and line[i + 1 : i + 4].isdigit():
                word.append(chr(int(line[i + 1 : i + 4], 8)))
                i += 4
            elif c == "\\":
                word.append({"n": "\n", "t": "\t", "r": "\r"}.get(line[i + 1], line[i + 1]))
                i += 2
            else:
                word.append(c)
                i += 1
        args.append("".join(word))
    return args


@pytest.fixture
def world_readable_dir() -> Iterator[Path]:
    """systemd's test mode refuses root, so it runs as nobody; pytest's tmp_path is 0700."""
    with tempfile.TemporaryDirectory(prefix="shoal-unit-") as name:
        path = Path(name)
        path.chmod(0o755)
        yield path


def _systemd_exec_start(unit_dir: Path, unit_name: str) -> list[str]:
    """How systemd itself splits the unit's ExecStart: ``systemd --test`` dumps the loaded
    unit without starting anything."""
    assert SYSTEMD_BINARY is not None
    runtime = unit_dir / "runtime"
    runtime.mkdir()
    command = [SYSTEMD_BINARY, "--test", "--user", f"--unit={unit_name}", "--no-pager"]
    if os.geteuid() == 0:
        os.chown(runtime, 65534, 65534)
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(runtime),
        "XDG_RUNTIME_DIR": str(runtime),
        "SYSTEMD_UNIT_PATH": f"{unit_dir}:",
        "SYSTEMD_LOG_TARGET": "console",
    }
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    out = done.stdout + done.stderr
    start = out.find(f"-> Unit {unit_name}:")
    assert start >= 0, out[-2000:]
    line_at = out.index("Command Line: ", out.index("-> ExecStart:", start))
    line = out[line_at + len("Command Line: ") : out.index("\n", line_at)]
    # systemd substitutes $VAR and collapses $$ when it runs the command, not when it loads
    return [arg.replace("$$", "$") for arg in _decode_dump_command(line)]


@pytest.mark.skipif(
    SYSTEMD_BINARY is None or (os.geteuid() == 0 and shutil.which("setpriv") is None),
    reason="systemd (for its --test dump) not installed, or setpriv missing to run it unprivileged",
)
def test_systemd_splits_exec_start_back_into_the_exact_arguments(
    world_readable_dir: Path,
) -> None:
    program = world_readable_dir / "bin dir 100%" / "python"
    program.parent.mkdir()
    program.symlink_to(sys.executable)
    exec_args = (str(program), "-m", "shoal", "worker", *NASTY_ARGS)
    the_spec = spec(exec_args=exec_args, user_mode=True)
    (world_readable_dir / the_spec.unit_name).write_text(systemd_unit(the_spec))
    (world_readable_dir / the_spec.unit_name).chmod(0o644)
    assert _systemd_exec_start(world_readable_dir, the_spec.unit_name) == list(exec_args)


def test_launchd_wrapper_exports_the_secrets_and_passes_arguments_intact(tmp_path: Path) -> None:
    """Runs the plist's ProgramArguments for real, with a program that reports what it got."""
    env_file = tmp_path / "Application Support" / "worker-qwen.env"
    env_file.parent.mkdir()
    secrets = {"SHOAL_GPU_KEY": GPU_KEY, "SHOAL_BACKEND_API_KEY": BACKEND_KEY, "X": "a=b c"}
    env_file.write_text(env_file_text(secrets))
    report = (
        "import json, os, sys; "
        "print(json.dumps([sys.argv[1:], {k: os.environ.get(k) for k in sys.argv[1:]}]))"
    )
    plist_safe = tuple(a for a in NASTY_ARGS if "\x01" not in a)
    args = ("SHOAL_GPU_KEY", "SHOAL_BACKEND_API_KEY", "X", *plist_safe)
    the_spec = spec(exec_args=(sys.executable, "-c", report, *args), env_file=env_file)
    argv = plistlib.loads(launchd_plist(the_spec))["ProgramArguments"]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"}
    )
    assert done.returncode == 0, done.stderr
    got_args, got_env = json.loads(done.stdout)
    assert got_args == list(args)
    assert {k: got_env[k] for k in secrets} == secrets


def test_launchd_wrapper_fails_when_the_env_file_is_missing(tmp_path: Path) -> None:
    the_spec = spec(exec_args=("/bin/echo", "started"), env_file=tmp_path / "missing.env")
    argv = launchd_arguments(the_spec)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert "started" not in done.stdout


# --- which flags, which secrets ---------------------------------------------------------


def test_worker_flags_are_the_given_ones_and_parse_back_through_the_cli(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SHOAL_SLOTS", "2")  # an env var the installer had counts as given
    given = settings(
        gpu_key=GPU_KEY,
        backend_api_key=BACKEND_KEY,
        model="models/tiny.gguf",
        llama_server_path=Path("bin/llama-server"),
        embedding=False,
        llama_server_args="--flash-attn on -ngl 99",
    )
    cwd = Path("/srv/here")
    flags = worker_flags(given, cwd)
    assert not any(secret in " ".join(flags) for secret in (GPU_KEY, BACKEND_KEY))
    assert "--ctx-size" not in flags  # left at its default: the worker's own default applies
    assert flags[flags.index("--model") + 1] == "/srv/here/models/tiny.gguf"
    assert flags[flags.index("--llama-server-path") + 1] == "/srv/here/bin/llama-server"
    assert "--no-embedding" in flags
    monkeypatch.delenv("SHOAL_SLOTS")
    parsed = settings_from_args(WorkerSettings, build_parser().parse_args(["worker", *flags]))
    assert parsed.slots == 2
    assert parsed.name == "qwen"
    assert parsed.router_url == "10.0.0.5:8000"
    assert parsed.llama_server_args == "--flash-attn on -ngl 99"
    assert parsed.model == "/srv/here/models/tiny.gguf"
    assert parsed.embedding is False
    assert parsed.gpu_key is None


def test_env_file_masked_text_hides_every_secret() -> None:
    text = env_file_text({"SHOAL_GPU_KEY": GPU_KEY, "HF_TOKEN": HF_TOKEN}, masked=True)
    assert GPU_KEY not in text and HF_TOKEN not in text
    assert 'SHOAL_GPU_KEY="***"' in text


def test_env_file_refuses_line_breaks() -> None:
    with pytest.raises(ServiceError, match="line break"):
        env_file_text({"SHOAL_GPU_KEY": "a\nb"})


# --- plans --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "has space", "a/b", "semi;colon", "..", "x" * 65, "ü"])
def test_invalid_service_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ServiceError, match="invalid service name"):
        plan_uninstall(name, options(tmp_path))


@pytest.mark.parametrize("name", ["qwen", "Qwen-2.5_b", "a"])
def test_valid_service_names(tmp_path: Path, name: str) -> None:
    assert plan_uninstall(name, options(tmp_path)).name == name


def test_invalid_worker_name_refused_at_install(tmp_path: Path) -> None:
    with pytest.raises(ServiceError, match="invalid service name"):
        plan_install(settings(name="my worker"), options(tmp_path))


def test_user_service_with_a_service_user_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ServiceError, match="--user service runs as you"):
        plan_install(settings(), options(tmp_path, user_mode=True, service_user="shoal"))


def test_unsupported_platform_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ServiceError, match="systemd .Linux. and launchd .macOS."):
        plan_install(settings(), options(tmp_path, platform="win32"))


@pytest.mark.parametrize(
    ("platform", "user_mode", "unit", "env_file", "commands"),
    [
        (
            "linux",
            False,
            "/etc/systemd/system/shoal-worker-qwen.service",
            "/etc/shoal/worker-qwen.env",
            [
                ("systemctl", "daemon-reload"),
                ("systemctl", "enable", "shoal-worker-qwen.service"),
                ("systemctl", "restart", "shoal-worker-qwen.service"),
            ],
        ),
        (
            "linux",
            True,
            "/home/alice/.config/systemd/user/shoal-worker-qwen.service",
            "/home/alice/.config/shoal/worker-qwen.env",
            [
                ("systemctl", "--user", "daemon-reload"),
                ("systemctl", "--user", "enable", "shoal-worker-qwen.service"),
                ("systemctl", "--user", "restart", "shoal-worker-qwen.service"),
                ("loginctl", "enable-linger"),
            ],
        ),
        (
            "darwin",
            False,
            "/Library/LaunchDaemons/dev.shoal.worker.qwen.plist",
            "/Library/Application Support/shoal/worker-qwen.env",
            [
                ("launchctl", "bootout", "system/dev.shoal.worker.qwen"),
                ("launchctl", "enable", "system/dev.shoal.worker.qwen"),
                (
                    "launchctl",
                    "bootstrap",
                    "system",
                    "/Library/LaunchDaemons/dev.shoal.worker.qwen.plist",
                ),
            ],
        ),
        (
            "darwin",
            True,
            "/home/alice/Library/LaunchAgents/dev.shoal.worker.qwen.plist",
            "/home/alice/Library/Application Support/shoal/worker-qwen.env",
            [
                ("launchctl", "bootout", "gui/1000/dev.shoal.worker.qwen"),
                ("launchctl", "enable", "gui/1000/dev.shoal.worker.qwen"),
                (
                    "launchctl",
                    "bootstrap",
                    "gui/1000",
                    "/home/alice/Library/LaunchAgents/dev.shoal.worker.qwen.plist",
                ),
            ],
        ),
    ],
)
def test_install_plan_table(
    tmp_path: Path,
    platform: str,
    user_mode: bool,
    unit: str,
    env_file: str,
    commands: list[tuple[str, ...]],
) -> None:
    plan = plan_install(
        settings(gpu_key=GPU_KEY), options(tmp_path, platform=platform, user_mode=user_mode)
    )
    writes = {str(s.path): s for s in plan.steps if isinstance(s, WriteFile)}
    assert set(writes) == {unit, env_file}
    assert writes[env_file].mode == 0o600
    assert writes[unit].mode == 0o644
    assert GPU_KEY.encode() not in writes[unit].content
    assert env_file.encode() in writes[unit].content
    assert [s.argv for s in plan.steps if isinstance(s, RunCommand)] == commands
    assert plan.needs_root is (not user_mode)


def test_dry_run_text_masks_secrets_and_lists_the_commands(tmp_path: Path) -> None:
    plan = plan_install(
        settings(gpu_key=GPU_KEY, backend_api_key=BACKEND_KEY),
        options(tmp_path, service_user="shoal", hf_token=SecretStr(HF_TOKEN)),
    )
    text = describe(plan)
    for secret in (GPU_KEY, BACKEND_KEY, HF_TOKEN):
        assert secret not in text
    for key in ("SHOAL_GPU_KEY", "SHOAL_BACKEND_API_KEY", "HF_TOKEN"):
        assert f'{key}="***"' in text
    assert "/etc/shoal/worker-qwen.env (mode 0600, owner shoal)" in text
    assert "/etc/systemd/system/shoal-worker-qwen.service (mode 0644)" in text
    assert "User=shoal" in text
    assert "needs root" in text
    runs = [line.strip() for line in text.splitlines() if line.strip().startswith("run: ")]
    assert runs == [
        "run: systemctl daemon-reload",
        "run: systemctl enable shoal-worker-qwen.service",
        "run: systemctl restart shoal-worker-qwen.service",
    ]


# --- apply --------------------------------------------------------------------------------


def _env_of(path: Path) -> dict[str, str]:
    """Read the env file the way the launchd wrapper does: with /bin/sh."""
    script = 'set -a; . "$1"; exec env -0'
    done = subprocess.run(
        ["/bin/sh", "-c", script, "sh", str(path)],
        capture_output=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin"},
    )
    pairs = (item.split("=", 1) for item in done.stdout.decode().split("\0") if "=" in item)
    return dict(pairs)


def test_apply_system_install_into_a_root(tmp_path: Path) -> None:
    opts = options(tmp_path, hf_token=SecretStr(HF_TOKEN))
    plan = plan_install(settings(gpu_key=GPU_KEY, backend_api_key=BACKEND_KEY), opts)
    systemctl = FakeSystemctl()
    apply(plan, systemctl, euid=0)
    unit = opts.root / "etc/systemd/system/shoal-worker-qwen.service"
    env_file = opts.root / "etc/shoal/worker-qwen.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644
    env = _env_of(env_file)
    assert {k: env.get(k) for k in ("SHOAL_GPU_KEY", "SHOAL_BACKEND_API_KEY", "HF_TOKEN")} == {
        "SHOAL_GPU_KEY": GPU_KEY,
        "SHOAL_BACKEND_API_KEY": BACKEND_KEY,
        "HF_TOKEN": HF_TOKEN,
    }
    assert "EnvironmentFile=/etc/shoal/worker-qwen.env" in unit.read_text()
    assert systemctl.calls == [
        ("systemctl", "daemon-reload"),
        ("systemctl", "enable", "shoal-worker-qwen.service"),
        ("systemctl", "restart", "shoal-worker-qwen.service"),
    ]
    assert not [p for p in env_file.parent.iterdir() if p.name.endswith(".tmp")]
    assert installed_names(opts) == ["qwen"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_apply_gives_the_secrets_file_to_the_service_user(tmp_path: Path) -> None:
    opts = options(tmp_path, service_user="nobody")
    apply(plan_install(settings(gpu_key=GPU_KEY), opts), FakeSystemctl(), euid=0)
    env_file = opts.root / "etc/shoal/worker-qwen.env"
    assert env_file.stat().st_uid == pwd.getpwnam("nobody").pw_uid
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    unit = opts.root / "etc/systemd/system/shoal-worker-qwen.service"
    assert unit.stat().st_uid == 0
    assert "User=nobody" in unit.read_text()


def test_apply_refuses_a_missing_service_user_before_writing(tmp_path: Path) -> None:
    opts = options(tmp_path, service_user="no-such-user-here")
    systemctl = FakeSystemctl()
    with pytest.raises(ServiceError, match="does not exist: create it first"):
        apply(plan_install(settings(), opts), systemctl, euid=0)
    assert not opts.root.exists() and systemctl.calls == []


def test_non_root_system_install_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    opts = options(tmp_path)
    systemctl = FakeSystemctl()
    with pytest.raises(ServiceError, match="needs root: run it with sudo, or pass --user"):
        apply(plan_install(settings(gpu_key=GPU_KEY), opts), systemctl, euid=1000)
    assert not opts.root.exists()
    assert systemctl.calls == []


def test_user_install_needs_no_root(tmp_path: Path) -> None:
    opts = options(tmp_path, user_mode=True)
    systemctl = FakeSystemctl()
    apply(plan_install(settings(gpu_key=GPU_KEY), opts), systemctl, euid=1000)
    env_dir = opts.root / "home/alice/.config/shoal"
    assert stat.S_IMODE(env_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((env_dir / "worker-qwen.env").stat().st_mode) == 0o600
    assert (opts.root / "home/alice/.config/systemd/user/shoal-worker-qwen.service").is_file()
    assert systemctl.calls[-1] == ("loginctl", "enable-linger")


def test_a_failing_command_stops_with_its_stderr(tmp_path: Path) -> None:
    systemctl = FakeSystemctl(fail={"restart": (1, "Job for shoal-worker-qwen.service failed.")})
    with pytest.raises(ServiceError, match=r"`systemctl restart .*` failed \(exit 1\): Job for"):
        apply(plan_install(settings(), options(tmp_path)), systemctl, euid=0)


def test_a_failing_optional_command_is_only_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    systemctl = FakeSystemctl(fail={"enable-linger": (1, "Access denied")})
    opts = options(tmp_path, user_mode=True)
    apply(plan_install(settings(), opts), systemctl, euid=1000)
    assert systemctl.calls[-1] == ("loginctl", "enable-linger")
    assert "Access denied" in caplog.text


def test_reinstall_replaces_the_files(tmp_path: Path) -> None:
    opts = options(tmp_path)
    apply(plan_install(settings(slots=2), opts), FakeSystemctl(), euid=0)
    apply(plan_install(settings(slots=8), opts), FakeSystemctl(), euid=0)
    unit = (opts.root / "etc/systemd/system/shoal-worker-qwen.service").read_text()
    assert "--slots 8" in unit and "--slots 2" not in unit


def test_uninstall_stops_and_removes(tmp_path: Path) -> None:
    opts = options(tmp_path)
    apply(plan_install(settings(name="other"), opts), FakeSystemctl(), euid=0)
    apply(plan_install(settings(gpu_key=GPU_KEY), opts), FakeSystemctl(), euid=0)
    systemctl = FakeSystemctl()
    apply(plan_uninstall("qwen", opts), systemctl, euid=0)
    assert not (opts.root / "etc/systemd/system/shoal-worker-qwen.service").exists()
    assert not (opts.root / "etc/shoal/worker-qwen.env").exists()
    assert (opts.root / "etc/shoal/worker-other.env").exists()
    assert systemctl.calls == [
        ("systemctl", "disable", "--now", "shoal-worker-qwen.service"),
        ("systemctl", "daemon-reload"),
    ]
    assert installed_names(opts) == ["other"]


def test_uninstall_launchd_agent(tmp_path: Path) -> None:
    opts = options(tmp_path, platform="darwin", user_mode=True)
    apply(plan_install(settings(), opts), FakeSystemctl(), euid=501)
    launchctl = FakeSystemctl(fail={"bootout": (3, "Boot-out failed: 3: No such process")})
    apply(plan_uninstall("qwen", opts), launchctl, euid=501)
    assert launchctl.calls == [("launchctl", "bootout", "gui/1000/dev.shoal.worker.qwen")]
    assert installed_names(opts) == []


def test_uninstalling_what_is_not_installed_says_what_is(tmp_path: Path) -> None:
    opts = options(tmp_path)
    apply(plan_install(settings(name="llama"), opts), FakeSystemctl(), euid=0)
    systemctl = FakeSystemctl()
    with pytest.raises(
        ServiceError, match="no worker service named 'qwen'.*installed there: llama"
    ):
        apply(plan_uninstall("qwen", opts), systemctl, euid=0)
    assert systemctl.calls == []


def test_non_root_system_uninstall_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ServiceError, match="needs root"):
        apply(plan_uninstall("qwen", options(tmp_path)), FakeSystemctl(), euid=1000)


def test_an_explicit_cache_dir_stays_writable_in_a_system_service(tmp_path: Path) -> None:
    given = settings(cache_dir=Path("/usr/local/shoal cache"))
    system = plan_install(given, options(tmp_path))
    unit = next(s for s in system.steps if isinstance(s, WriteFile) and s.mode == 0o644)
    text = unit.content.decode()
    assert 'ReadWritePaths="-/usr/local/shoal cache"' in text
    assert '--cache-dir "/usr/local/shoal cache"' in text
    user = plan_install(given, options(tmp_path, user_mode=True))
    user_unit = next(s for s in user.steps if isinstance(s, WriteFile) and s.mode == 0o644)
    assert b"ReadWritePaths" not in user_unit.content  # no ProtectSystem= there to undo


# --- what would keep the service from working ----------------------------------------------


@pytest.mark.parametrize(
    ("given", "user_mode", "problem"),
    [
        ({}, False, "no --gpu-key: the router at 10.0.0.5:8000"),
        ({}, True, "no --gpu-key"),
        ({"router_url": "127.0.0.1:8000"}, False, None),  # a loopback router may do without
        ({"router_url": "localhost:8000,10.0.0.6:8000"}, False, "no --gpu-key"),
        ({"redis_url": "redis://10.0.0.7:6379/0"}, False, None),  # pull mode: no key used
        ({"gpu_key": GPU_KEY}, False, None),
        ({"gpu_key": GPU_KEY, "model": "/tmp/m.gguf"}, False, "--model /tmp/m.gguf: the service"),
        ({"gpu_key": GPU_KEY, "tls_ca": Path("/var/tmp/ca.pem")}, False, "--tls-ca /var/tmp"),
        ({"gpu_key": GPU_KEY, "model_path": Path("/tmp/m.gguf")}, True, None),  # no PrivateTmp
        ({"gpu_key": GPU_KEY, "cache_dir": Path("/tmpfoo/cache")}, False, None),
    ],
)
def test_a_service_that_would_not_work_is_flagged(
    tmp_path: Path, given: dict[str, object], user_mode: bool, problem: str | None
) -> None:
    plan = plan_install(settings(**given), options(tmp_path, user_mode=user_mode))
    text = describe(plan)
    if problem is None:
        assert plan.problems == () and "Warning" not in text
    else:
        assert any(problem in p for p in plan.problems), plan.problems
        assert f"Warning: this service would not work: {plan.problems[0]}" in text


def test_a_relative_path_is_judged_where_it_will_point(tmp_path: Path) -> None:
    plan = plan_install(
        settings(gpu_key=GPU_KEY, model="m.gguf"), options(tmp_path, cwd=Path("/tmp/work"))
    )
    assert any("--model /tmp/work/m.gguf" in p for p in plan.problems)


def test_install_refuses_what_dry_run_warns_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from shoal.cli.main import main

    monkeypatch.setenv("HOME", str(tmp_path))  # a --user install would write under it
    argv = ["worker", "install", "--name", "qwen", "--router-url", "10.0.0.5:8000", "--user"]
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "Warning: this service would not work: no --gpu-key" in out
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "not installing worker service 'qwen', it would not work: no --gpu-key" in captured.err
    assert captured.out == "" and not (tmp_path / ".config").exists()
