"""The command line reads well and every flag mirrors a SHOAL_* variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic_settings import BaseSettings

from cluster import clean_env
from shoal.cli.main import build_parser
from shoal.data.settings import DataSettings
from shoal.router.settings import RouterSettings
from shoal.settings import env_name, settings_from_args
from shoal.up.settings import UpSettings
from shoal.worker.settings import WorkerSettings


def test_help_lists_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shoal", "--help"],
        capture_output=True,
        text=True,
        env=clean_env(),
        check=True,
    ).stdout
    for word in ("up", "router", "worker", "llama-cpp", "SHOAL_"):
        assert word in out


@pytest.mark.parametrize("command, cls", [("router", RouterSettings), ("worker", WorkerSettings)])
def test_every_flag_has_its_env_var(
    command: str, cls: type, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name, info in cls.model_fields.items():
        assert f"--{name.replace('_', '-')}" in help_text
        assert f"[env: {env_name(name, info)}" in help_text


@pytest.mark.parametrize(
    ("command", "cls", "variable"),
    [
        ("router", RouterSettings, "SHOAL_ROUTER_API_KEY"),
        ("up", UpSettings, "SHOAL_ROUTER_API_KEY"),
        ("data", DataSettings, "SHOAL_DATA_API_KEY"),
    ],
)
def test_a_servers_api_key_is_read_from_its_own_variable_never_a_clients(
    command: str, cls: type[BaseSettings], variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's variables (SHOAL_API_KEY, which the README once told clients to export,
    and OPENAI_API_KEY) grant nothing on a server; the server's own variable does."""
    monkeypatch.setenv("SHOAL_API_KEY", "client-key")
    monkeypatch.setenv("OPENAI_API_KEY", "client-key")
    settings: Any = settings_from_args(cls, build_parser().parse_args([command]))
    assert not settings.api_key
    monkeypatch.setenv(variable, "server-key")
    settings = settings_from_args(cls, build_parser().parse_args([command]))
    keys = settings.api_key if isinstance(settings.api_key, tuple) else (settings.api_key,)
    assert [getattr(k, "get_secret_value", lambda k=k: k)() for k in keys] == ["server-key"]


def test_flags_beat_env_which_beats_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_MAX_QUEUE", "7")
    monkeypatch.setenv("SHOAL_PORT", "9001")
    monkeypatch.setenv("SHOAL_ROUTER_API_KEY", "k1, k2")
    args = build_parser().parse_args(["router", "--port", "9002"])
    s = settings_from_args(RouterSettings, args)
    assert (s.port, s.max_queue, s.max_wait) == (9002, 7, 60.0)
    assert [k.get_secret_value() for k in s.api_key] == ["k1", "k2"]
    assert "k1" not in repr(s)  # secrets never print


def test_preempt_is_on_by_default_and_off_by_flag_or_env(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = build_parser().parse_args
    assert settings_from_args(RouterSettings, parse(["router"])).preempt
    assert not settings_from_args(RouterSettings, parse(["router", "--no-preempt"])).preempt
    monkeypatch.setenv("SHOAL_PREEMPT", "false")
    assert not settings_from_args(RouterSettings, parse(["router"])).preempt
    assert settings_from_args(RouterSettings, parse(["router", "--preempt"])).preempt


def test_router_refuses_open_network_without_keys(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "shoal", "router", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env=clean_env(SHOAL_DATABASE_URL=f"sqlite:///{tmp_path}/shoal.db"),
        timeout=30,
    )
    assert r.returncode == 2
    assert "refusing to listen on 0.0.0.0 without API keys (--api-key, or `shoal keys" in r.stderr
    assert "and GPU keys (--gpu-key" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_router_that_relied_on_the_clients_variable_does_not_start_open(
    tmp_path: Path,
) -> None:
    """SHOAL_API_KEY was a router's key once; ignored now, a loopback router that relied on
    it (behind a proxy, say) would serve everyone: with no API key it does not start."""
    r = subprocess.run(
        [sys.executable, "-m", "shoal", "router", "--port", "1"],
        capture_output=True,
        text=True,
        env=clean_env(
            SHOAL_DATABASE_URL=f"sqlite:///{tmp_path}/shoal.db", SHOAL_API_KEY="sk-operator"
        ),
        timeout=30,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "refusing to start with open API routes while SHOAL_API_KEY is set" in r.stderr
    assert "SHOAL_ROUTER_API_KEY" in r.stderr and "unset SHOAL_API_KEY" in r.stderr
    assert "sk-operator" not in r.stderr and "Traceback" not in r.stderr


def test_bad_option_value_is_a_clear_error() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "shoal", "router", "--port", "http"],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=30,
    )
    assert r.returncode == 2 and "invalid option: port" in r.stderr
    assert "Traceback" not in r.stderr


def test_an_option_that_conflicts_with_another_names_both_flags() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "shoal", "router", "--stall-timeout", "1"],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=30,
    )
    assert r.returncode == 2
    assert "invalid option: --stall-timeout (1 s) must be above --heartbeat-interval" in r.stderr
    assert "value:" not in r.stderr and "Value error" not in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--prefix-hold", "-1"], {}, "invalid option: prefix_hold: Input should be greater"),
        (["--prefix-hold", "soon"], {}, "invalid option: prefix_hold: Input should be a valid"),
        (
            ["--redis-url", "redis://127.0.0.1:6379/0"],
            {"SHOAL_PREFIX_HOLD": "100"},
            "--prefix-hold (100 s) must be below --max-wait (60 s)",
        ),
        (
            ["--redis-url", "redis://127.0.0.1:6379/0", "--prefix-hold", "5", "--max-wait", "5"],
            {},
            "--prefix-hold (5 s) must be below",
        ),
    ],
)
def test_a_prefix_hold_out_of_range_is_refused_with_what_to_do(
    args: list[str], env: dict[str, str], expected: str
) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "shoal", "router", *args],
        capture_output=True,
        text=True,
        env=clean_env(**env),
        timeout=30,
    )
    assert r.returncode == 2
    assert expected in r.stderr
    assert "Traceback" not in r.stderr


def test_worker_install_dry_run_and_uninstall_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from shoal.cli.main import main

    code = main(
        [
            "worker",
            "install",
            "--name",
            "qwen",
            "--gpu-key",
            "s3cret-key",
            "--router-url",
            "10.0.0.5:8000",
            "--model",
            "qwen2.5-7b-instruct",
            "--user",
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "s3cret-key" not in out and 'SHOAL_GPU_KEY="***"' in out
    assert "worker --router-url 10.0.0.5:8000 --name qwen --model qwen2.5-7b-instruct" in out
    assert "systemctl --user enable shoal-worker-qwen.service" in out
    code = main(["worker", "uninstall", "--name", "no-such-worker", "--user", "--dry-run"])
    assert code == 2 and "no-such-worker" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "flag", "meant"),
    [
        (["worker", "--router-ulr", "127.0.0.1:1", "--name", "t"], "--router-ulr", "--router-url"),
        (["worker", "--gpu_key", "k", "--name", "t"], "--gpu_key", "--gpu-key"),
        (["worker", "--modle", "qwen3-4b"], "--modle", "--model"),
        (
            ["worker", "install", "--router-ulr=r:8000", "--name", "t"],
            "--router-ulr",
            "--router-url",
        ),
        (["router", "--prot", "9000"], "--prot", "--port"),
    ],
)
def test_a_misspelled_flag_is_named_with_the_one_meant(
    argv: list[str], flag: str, meant: str
) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "shoal", *argv],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=30,
    )
    assert r.returncode == 2
    assert f"unrecognized argument {flag}; did you mean {meant}?" in r.stderr
    assert "invalid choice" not in r.stderr and "ACTION" not in r.stderr
    assert len(r.stderr.splitlines()) <= 2, r.stderr  # not the whole usage


def test_values_that_look_like_flags_still_parse() -> None:
    args = build_parser().parse_args(
        ["worker", "--llama-server-args", "--flash-attn on -ngl 99", "--router", "r:8000"]
    )
    s = settings_from_args(WorkerSettings, args)
    assert s.llama_server_args == "--flash-attn on -ngl 99"
    assert s.router_url == "r:8000"  # an abbreviation argparse resolves is fine


def test_router_help_says_what_redis_shares(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "later" not in help_text
    assert "the job queue (any router takes any request" in help_text


@pytest.mark.parametrize("argv", [["doctor", "--json"], ["models", "list"]])
def test_a_reader_that_stops_early_gets_no_traceback(argv: list[str]) -> None:
    """``shoal doctor --json | head``: the reader is gone before the command writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader left: the command's first write meets a closed pipe
    try:
        r = subprocess.run(
            [sys.executable, "-m", "shoal", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert r.stderr == "" and r.returncode == 141
