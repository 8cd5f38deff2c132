"""Where stored responses (the Responses API's ``store: true``) live: the ``ResponseStore``
protocol and what it keeps, a ``StoredResponse``. ``memory.py`` keeps them in this router
(lost on restart), ``redis.py`` in Redis (read by every router on the same Redis and prefix,
so a follow-up with ``previous_response_id`` may reach any of them). Both forget a response
``ttl_s`` seconds after it was stored (the router's ``--job-ttl``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class StoredResponse:
    owner: str | None
    """The id of the key that created it (None: a flag key or open access); only a request
    with the same key reads, continues or deletes it."""
    response: dict[str, Any]
    """The response object, as the client got it."""
    items: list[dict[str, Any]]
    """The conversation through this response: every input item it was given (those of the
    responses before it included), then its output items."""

    @property
    def id(self) -> str:
        return str(self.response["id"])


class ResponseStore(Protocol):
    async def put(self, stored: StoredResponse) -> None: ...

    async def get(self, response_id: str) -> StoredResponse | None:
        """The response, or None when it was never stored, was deleted or expired."""

    async def delete(self, response_id: str) -> bool:
        """Forget it; False when there was nothing to forget."""
