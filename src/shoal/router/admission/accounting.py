"""What a request costs its key: admitted against its rate limits, charged when its job ends.

``admit`` runs before a job is queued: requests/min and tokens/min (a 429 with
``Retry-After`` and ``x-ratelimit-*`` headers when spent), and a concurrent-stream slot for
streamed requests. ``finish`` runs once when the response is over, whatever happened: it
charges the tokens the answer used, releases the stream slot, records usage for the key and
counts the tokens and the outcome in the metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from shoal.keys import KeyStore
from shoal.router.admission.auth import Principal
from shoal.router.admission.ratelimit.interface import RateLimited, RateLimiter, StreamSlot
from shoal.router.dispatch.job import Job
from shoal.router.errors import RateLimitExceeded
from shoal.router.observe.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class Ticket:
    """One admitted request: who pays, what was reserved, the headers to send back."""

    principal: Principal
    headers: dict[str, str] = field(default_factory=dict)
    reserved_tokens: int = 0
    slot: StreamSlot | None = None
    finished: bool = False


class Accounting:
    def __init__(self, limiter: RateLimiter, store: KeyStore | None, metrics: Metrics) -> None:
        self.limiter = limiter
        self.store = store
        self.metrics = metrics

    async def admit(self, principal: Principal, *, stream: bool, max_tokens: int) -> Ticket:
        """Admit one request for ``principal`` or raise ``RateLimitExceeded`` (429)."""
        ticket = Ticket(principal)
        if principal.key_id is None or not principal.limited:
            return ticket
        assert principal.limits is not None
        try:
            admission = await self.limiter.admit(principal.key_id, principal.limits, max_tokens)
            ticket.headers.update(admission.headers)
            ticket.reserved_tokens = admission.reserved_tokens
            if stream and principal.limits.max_streams is not None:
                ticket.slot = await self.limiter.stream_started(principal.key_id, principal.limits)
        except RateLimited as exc:
            if ticket.reserved_tokens:  # admitted for tokens, refused a stream slot
                await self.limiter.charge_tokens(
                    principal.key_id, principal.limits, 0, ticket.reserved_tokens
                )
            log.info("key %s (%s): rate limited: %s", principal.key_id, principal.name, exc.message)
            raise RateLimitExceeded(exc.message, headers=exc.headers) from None
        return ticket

    async def release(self, ticket: Ticket) -> None:
        """Give back what ``admit`` took, for a request refused before it became a job."""
        principal = ticket.principal
        if principal.key_id and principal.limits is not None and ticket.reserved_tokens:
            await self.limiter.charge_tokens(
                principal.key_id, principal.limits, 0, ticket.reserved_tokens
            )
        if ticket.slot is not None:
            await ticket.slot.release()
        ticket.finished = True

    async def keepalive(self, ticket: Ticket) -> None:
        """A long stream keeps its slot's lease (cheap: renews at most every few seconds)."""
        if ticket.slot is not None:
            await ticket.slot.keepalive()

    async def finish(
        self, ticket: Ticket, job: Job, tokens: tuple[int, int] | None, cached: int | None = None
    ) -> None:
        """Charge ``job``'s tokens to the ticket's key and release what it held. Idempotent.
        ``cached``: of the prompt tokens, those the backend reused from its cache."""
        if ticket.finished:
            return
        ticket.finished = True
        self.metrics.job_finished(job.model, job.state.value)
        used_in, used_out = tokens or (0, 0)
        if tokens is not None:
            self.metrics.tokens(job.model, used_in, used_out)
            if cached is not None:
                self.metrics.prompt_cache(job.model, min(cached, used_in), used_in)
        principal = ticket.principal
        if principal.key_id is None:
            return
        if self.store is not None:
            self.store.record_usage(principal.key_id, job.model, 1, used_in, used_out)
        if principal.limits is not None and principal.limits.tokens_per_min is not None:
            await self.limiter.charge_tokens(
                principal.key_id, principal.limits, used_in + used_out, ticket.reserved_tokens
            )
        if ticket.slot is not None:
            await ticket.slot.release()
