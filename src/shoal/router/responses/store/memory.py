"""Stored responses in this router's memory: lost on restart, the oldest dropped past a bound."""

from __future__ import annotations

import time
from collections import OrderedDict

from shoal.router.responses.store.interface import StoredResponse

MEMORY_MAX_RESPONSES = 10_000
"""The most responses a router keeps in memory; past it the oldest go first."""


class MemoryResponseStore:
    def __init__(self, ttl_s: float, max_responses: int = MEMORY_MAX_RESPONSES) -> None:
        self.ttl_s = ttl_s
        self.max_responses = max_responses
        self._kept: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    async def put(self, stored: StoredResponse) -> None:
        self._kept[stored.id] = (time.monotonic() + self.ttl_s, stored)
        self._kept.move_to_end(stored.id)
        while len(self._kept) > self.max_responses:
            self._kept.popitem(last=False)

    async def get(self, response_id: str) -> StoredResponse | None:
        kept = self._kept.get(response_id)
        if kept is None:
            return None
        if kept[0] <= time.monotonic():
            del self._kept[response_id]
            return None
        return kept[1]

    async def delete(self, response_id: str) -> bool:
        return await self.get(response_id) is not None and bool(self._kept.pop(response_id))
