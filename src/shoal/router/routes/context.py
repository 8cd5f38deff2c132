"""What route handlers share: built once by the composition root, reached via the request."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection

from shoal.keys import KeyStore
from shoal.router.admission.accounting import Accounting
from shoal.router.admission.auth import KeyCheck
from shoal.router.admission.result_cache.interface import ResultCache
from shoal.router.async_jobs.service import JobsService
from shoal.router.deployments.controller import Deployments
from shoal.router.dispatch.interface import Dispatcher
from shoal.router.dispatch.workers import Registry
from shoal.router.responses.store.interface import ResponseStore
from shoal.router.settings import RouterSettings


@dataclass(frozen=True)
class RouterContext:
    settings: RouterSettings
    registry: Registry
    dispatcher: Dispatcher
    keys: KeyCheck
    accounting: Accounting
    store: KeyStore
    """The key database (API keys and usage)."""
    jobs: JobsService
    """The async jobs API (/v1/jobs)."""
    cache: ResultCache | None
    """The result cache; None when --cache is off."""
    deployments: Deployments
    """The controller of the models split over workers."""
    responses: ResponseStore
    """Responses stored with ``store: true`` (the Responses API), in memory or Redis."""


def context(conn: HTTPConnection) -> RouterContext:
    ctx: RouterContext = conn.app.state.ctx
    return ctx
