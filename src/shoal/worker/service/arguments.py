"""What a worker service runs with: the flags the user gave, and the secrets kept apart."""

from __future__ import annotations

import enum
from pathlib import Path

from pydantic import SecretStr

from shoal.settings import ENV_PREFIX
from shoal.worker.service.units import ServiceError
from shoal.worker.settings import WorkerSettings

HF_TOKEN_ENV = "HF_TOKEN"
"""Read by huggingface_hub when the worker downloads a gated model."""

_ENV_ESCAPE = str.maketrans({c: "\\" + c for c in '\\"$`'})


def worker_flags(settings: WorkerSettings, cwd: Path) -> tuple[str, ...]:
    """The flags the user gave (on the command line or as SHOAL_* variables), secrets left
    out, paths made absolute (a service does not start in the directory you are in)."""
    flags: list[str] = []
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if name not in settings.model_fields_set or value is None or _is_secret(value):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
            continue
        if isinstance(value, Path) or (name == "model" and value.lower().endswith(".gguf")):
            value = cwd / Path(value).expanduser()
        elif isinstance(value, tuple):
            value = ",".join(str(v) for v in value)
        elif isinstance(value, enum.Enum):
            value = value.value
        flags += [flag, str(value)]
    return tuple(flags)


def _is_secret(value: object) -> bool:
    return isinstance(value, SecretStr) or (
        isinstance(value, tuple) and any(isinstance(v, SecretStr) for v in value)
    )


def secret_env(settings: WorkerSettings, hf_token: SecretStr | None) -> dict[str, str]:
    """The secrets, as the environment variables the worker reads them from."""
    env: dict[str, str] = {}
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            env[ENV_PREFIX + name.upper()] = value.get_secret_value()
        elif _is_secret(value):
            env[ENV_PREFIX + name.upper()] = ",".join(v.get_secret_value() for v in value)
    if hf_token is not None:
        env[HF_TOKEN_ENV] = hf_token.get_secret_value()
    return env


def env_file_text(env: dict[str, str], *, masked: bool = False) -> str:
    """``KEY="value"`` lines, escaped so systemd's EnvironmentFile= and POSIX sh's ``.``
    read the same value: inside double quotes both unescape exactly ``\\ " $ ` ``."""
    lines = ["# Secrets of a Shoal worker service, written by `shoal worker install`."]
    for key, value in env.items():
        if any(c in value for c in "\n\r\0"):
            raise ServiceError(f"{key} contains a line break or NUL; pass the value without it")
        shown = "***" if masked else value.translate(_ENV_ESCAPE)
        lines.append(f'{key}="{shown}"')
    return "\n".join(lines) + "\n"
