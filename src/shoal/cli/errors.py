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
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors()
        )
        raise UserError(f"invalid option: {problems}") from None
