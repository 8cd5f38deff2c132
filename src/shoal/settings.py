"""Settings shared by every Shoal process, and the bridge from settings to CLI flags.

Each process builds exactly one settings object (``RouterSettings``, ``WorkerSettings``,
``UpSettings``) from, in order of precedence: command-line flags, ``SHOAL_*`` environment
variables, defaults. Flags are derived from the fields, so every flag has its env var:
``SHOAL_`` and the field's name, or the variable a field names itself (``Variable``).

No server reads an inference client's variable. A client's shell holds its key (the OpenAI
convention: ``OPENAI_API_KEY`` and ``OPENAI_BASE_URL``); a router reads the API keys it
accepts from a variable of its own (``SHOAL_ROUTER_API_KEY``), so a router started from a
client's shell is not opened to that client's key. ``SHOAL_API_KEY``, which clients were told
to export once, is read by no command; a server started where it is set says so
(``client_key_ignored``), and a router it left with no API key does not start. (The worker
key, ``SHOAL_GPU_KEY``, is the one variable both sides read: the keys a router accepts from
workers, the key a worker presents; both ends are the operator's own.)
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import Field, SecretStr, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from shoal.paths import default_cache_dir

KEEP_ALIVE_S = 75
"""Seconds an idle client connection stays open (nginx's default too): every server's
default (``serving.py``), the router's ``--keep-alive``.

A server that closes an idle connection races a client that is just reusing it: a request
written as the server closes is lost (``Server disconnected without sending a response``).
Only the side that closes first avoids it, so this must outlast the time client pools keep
idle connections: httpx and the openai client 5 s (uvicorn's own default is also 5 s, hence
the race), aiohttp 15 s, nginx upstream pools 60 s. Behind a proxy that keeps them longer,
raise the router's ``--keep-alive`` above the proxy's idle timeout.
"""

ENV_PREFIX = "SHOAL_"
CLIENT_KEY_VARIABLE = "SHOAL_API_KEY"
"""What the README once told clients to export: read by no command, never a server's."""

CommaList = Annotated[tuple[str, ...], NoDecode]
SecretList = Annotated[tuple[SecretStr, ...], NoDecode]


def split_commas(value: object) -> object:
    """Lists arrive as ``a,b,c`` from flags and env vars alike."""
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


@dataclasses.dataclass(frozen=True)
class Variable:
    """Marks a settings field read from this environment variable instead of ``SHOAL_<FIELD>``
    (``Annotated[SecretList, Variable("SHOAL_ROUTER_API_KEY")]``): a key a server accepts,
    which must not be read from a variable of the same name a client's shell holds. The flag
    is unchanged, ``--help`` names the variable, and ``SHOAL_<FIELD>`` is not read."""

    name: str


def server_variable(role: str, name: str) -> Variable:
    """The variable of a server's field ``name``: ``SHOAL_ROUTER_API_KEY`` for the router's
    ``api_key``."""
    return Variable(f"{ENV_PREFIX}{role.upper()}_{name.upper()}")


def own_variable(info: FieldInfo) -> str | None:
    """The variable a field is read from when it names its own (``Variable``)."""
    return next((m.name for m in info.metadata if isinstance(m, Variable)), None)


def env_name(name: str, info: FieldInfo) -> str:
    """The environment variable of the settings field ``name``."""
    return own_variable(info) or ENV_PREFIX + name.upper()


def flag_and_variable(settings_cls: type[BaseSettings], name: str) -> str:
    """How a user sets field ``name``: ``--api-key/SHOAL_ROUTER_API_KEY``."""
    return f"{_flag(name)}/{env_name(name, settings_cls.model_fields[name])}"


class _Environment(PydanticBaseSettingsSource):
    """pydantic-settings' ``SHOAL_*`` variables, except that a field with a ``Variable`` of
    its own is read from that one only."""

    def __init__(self, settings_cls: type[BaseSettings], env: PydanticBaseSettingsSource) -> None:
        super().__init__(settings_cls)
        self.env = env

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ gives every value at once

    def __call__(self) -> dict[str, Any]:
        values = self.env()
        for name, info in self.settings_cls.model_fields.items():
            variable = own_variable(info)
            if variable is None:
                continue
            values.pop(name, None)  # what SHOAL_<FIELD> held: a client's variable, maybe
            if variable in os.environ:
                values[name] = os.environ[variable]
        return values


def client_key_ignored(environ: Mapping[str, str], server: str, accepted: str) -> str | None:
    """The warning for ``server`` started where a client's key variable is set, or None;
    ``accepted`` says where the keys it does accept come from."""
    if CLIENT_KEY_VARIABLE not in environ:
        return None
    return (
        f"{CLIENT_KEY_VARIABLE} is set here and ignored: it is a client's variable and grants "
        f"nothing on {server}, which takes keys from {accepted}. Clients read OPENAI_API_KEY "
        "(and OPENAI_BASE_URL)."
    )


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        environment = _Environment(settings_cls, env_settings)
        return init_settings, environment, dotenv_settings, file_secret_settings

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


class TlsServerSettings(CommonSettings):
    """A server that may serve HTTPS (the router, the model store): one pair of flags, one
    meaning (``shoal.serving.tls_files`` reads them)."""

    tls_cert: Path | None = Field(
        None, description="TLS certificate (PEM) to serve HTTPS (and WSS); needs --tls-key."
    )
    tls_key: Path | None = Field(None, description="TLS private key (PEM) for --tls-cert.")


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
        env = env_name(name, info)
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
            extra = info.json_schema_extra
            repeat = isinstance(extra, dict) and bool(extra.get("repeatable"))
            group.add_argument(
                _flag(name),
                dest=name,
                default=argparse.SUPPRESS,
                action="append" if repeat else "store",
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
    given: dict[str, Any] = {
        name: ",".join(value) if isinstance(value, list) else value
        for name, value in vars(args).items()
        if name in settings_cls.model_fields and value is not None
    }
    return settings_cls(**given)
