"""What route handlers share: built once by the composition root, reached via the request."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection

from shoal.router.auth import KeyCheck
from shoal.router.dispatch import Dispatcher
from shoal.router.settings import RouterSettings
from shoal.router.workers import Registry


@dataclass(frozen=True)
class RouterContext:
    settings: RouterSettings
    registry: Registry
    dispatcher: Dispatcher
    keys: KeyCheck


def context(conn: HTTPConnection) -> RouterContext:
    ctx: RouterContext = conn.app.state.ctx
    return ctx
