"""What every command shares: the user-facing error and building settings from flags."""

from __future__ import annotations

import argparse
from typing import TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from shoal.settings import settings_from_args

S = TypeVar("S", bound=BaseSettings)


class UserError(Exception):
    """Something the user can fix; printed without a traceback."""


def settings_for(cls: type[S], args: argparse.Namespace) -> S:
    """The command's settings from its flags and SHOAL_* variables; bad values -> UserError."""
    try:
        return settings_from_args(cls, args)
    except ValidationError as exc:
        raise UserError(f"invalid option: {_problems(exc)}") from None


def _problems(exc: ValidationError) -> str:
    """Each problem as ``field: message``; one that concerns several flags by its message alone."""
    parts = []
    for e in exc.errors():
        message = e["msg"].removeprefix("Value error, ")
        field = ".".join(str(p) for p in e["loc"])
        parts.append(f"{field}: {message}" if field else message)
    return "; ".join(parts)
