"""Small helpers shared by the route modules."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from starlette.responses import Response

from shoal.protocol.ids import ModelName
from shoal.protocol.messages import Endpoint
from shoal.router.admission.accounting import Ticket
from shoal.router.admission.auth import Principal
from shoal.router.dispatch.fair_queue import Tenant
from shoal.router.dispatch.job import Job, Submission
from shoal.router.errors import RouterError

if TYPE_CHECKING:
    from shoal.router.routes.context import RouterContext


def json_response(payload: object, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def tenant(principal: Principal) -> Tenant:
    """Whom a request's job queues for: its API key, with the key's weight, class and queue
    cap (``shoal keys update``); else one tenant for every flag key and one for callers of
    an open router."""
    q = principal.queueing
    return Tenant(principal.key_id or principal.name, q.weight, q.priority, q.max_queued)


async def admit_and_submit(
    ctx: RouterContext,
    principal: Principal,
    model: str,
    endpoint: Endpoint,
    stream: bool,
    body: dict[str, Any],
    *,
    max_tokens: int = 0,
) -> tuple[Job, Ticket]:
    """Admit a checked request against its key's limits (``max_tokens`` reserved), then queue
    its job; what the admission took is given back if the queue refuses the job."""
    ticket = await ctx.accounting.admit(principal, stream=stream, max_tokens=max_tokens)
    ask = Submission(
        ModelName(model), endpoint, stream, body, tenant(principal), key_id=principal.key_id
    )
    try:
        return ctx.dispatcher.submit(ask), ticket
    except RouterError:
        await ctx.accounting.release(ticket)
        raise
