"""GET /metrics: the router's Prometheus metrics, behind the key check the app installs.

The app provides ``app.state.metrics`` (a ``Metrics``) and ``app.state.metrics_auth`` (a
coroutine function that raises a ``RouterError`` when the request's headers are not allowed:
the router's admin key check).
The handler is ``async`` on purpose: rendering reads dispatcher state and the per-chunk
histogram, which belong to the event loop's thread (a sync handler would run in a pool).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from starlette.datastructures import Headers
from starlette.responses import Response

from shoal.router.observe.metrics import Metrics

router = APIRouter()

MetricsAuth = Callable[[Headers], Awaitable[object]]


class MetricsNotInstalled(RuntimeError):
    pass


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition of the router's metrics."""
    state = request.app.state
    found: Metrics | None = getattr(state, "metrics", None)
    check: MetricsAuth | None = getattr(state, "metrics_auth", None)
    if found is None or check is None:
        raise MetricsNotInstalled(
            "GET /metrics needs app.state.metrics and app.state.metrics_auth; "
            "set both in the app's composition root"
        )
    await check(request.headers)
    body, content_type = found.render()
    return Response(body, media_type=content_type)
