"""Settings shared by every Shoal process, and the bridge from settings to CLI flags.

Each process builds exactly one settings object (``RouterSettings``, ``WorkerSettings``,
``UpSettings``) from, in order of precedence: command-line flags, ``SHOAL_*`` environment
variables, defaults. Flags are derived from the fields, so every flag has its env var.
"""

from __future__ import annotations

import argparse
import enum
import types
import typing
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import Field, SecretStr, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shoal.paths import default_cache_dir

ENV_PREFIX = "SHOAL_"

CommaList = Annotated[tuple[str, ...], NoDecode]
SecretList = Annotated[tuple[SecretStr, ...], NoDecode]


def split_commas(value: object) -> object:
    """Lists arrive as ``a,b,c`` from flags and env vars alike."""
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="Where llama.cpp builds, models and logs are cached.",
    )
    log_level: str = Field("info", description="Log level: debug, info, warning or error.")

    @field_validator("log_level")
    @classmethod
    def _check_level(cls, value: str) -> str:
        value = value.lower()
        if value not in {"debug", "info", "warning", "error"}:
            raise ValueError("log level must be one of debug, info, warning, error")
        return value


S = TypeVar("S", bound=BaseSettings)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    args = typing.get_args(annotation)
    return isinstance(annotation, types.UnionType) and bool in args and len(args) == 2


def add_settings_flags(
    parser: argparse.ArgumentParser,
    settings_cls: type[BaseSettings],
    *,
    skip: frozenset[str] = frozenset(),
) -> None:
    """Add one flag per settings field, documenting the env var and the default."""
    group = parser.add_argument_group("options (each also read from its SHOAL_* variable)")
    for name, info in settings_cls.model_fields.items():
        if name in skip:
            continue
        env = ENV_PREFIX + name.upper()
        help_text = f"{info.description or ''} [env: {env}{_default_text(info)}]"
        if _is_bool(info.annotation):
            group.add_argument(
                _flag(name),
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            group.add_argument(
                _flag(name),
                dest=name,
                default=argparse.SUPPRESS,
                metavar=name.upper(),
                help=help_text,
            )


def _default_text(info: FieldInfo) -> str:
    if info.default_factory is not None or info.default is None:
        return ""
    default = info.default
    if isinstance(default, enum.Enum):
        default = default.value
    if isinstance(default, tuple):
        default = ",".join(str(d) for d in default) or None
    if default in (None, "", ()):
        return ""
    if isinstance(default, bool):
        return f"; default: {'on' if default else 'off'}"
    return f"; default: {default}"


def settings_from_args(settings_cls: type[S], args: argparse.Namespace) -> S:
    """Flags given on the command line win over env vars, which win over defaults."""
    given = {
        name: value
        for name, value in vars(args).items()
        if name in settings_cls.model_fields and value is not None
    }
    return settings_cls(**given)
