"""``ResultCache`` in this router's memory (``--cache`` without ``--redis-url``)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from shoal.router.admission.result_cache.interface import CachedAnswer


class MemoryResultCache:
    """``ResultCache`` in this router's memory: least recently used entries go first, past
    ``max_entries`` or ``max_chars`` in all; an entry older than ``ttl_s`` is a miss."""

    def __init__(
        self,
        max_entries: int,
        ttl_s: float,
        *,
        max_chars: int = 256 * 1024 * 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.ttl_s = ttl_s
        self.clock = clock
        self.chars = 0
        self._entries: OrderedDict[str, tuple[float, CachedAnswer]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> CachedAnswer | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires, answer = entry
        if expires <= self.clock():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return answer

    async def put(self, key: str, answer: CachedAnswer) -> None:
        if answer.size > self.max_chars or self.max_entries < 1:
            return
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (self.clock() + self.ttl_s, answer)
        self.chars += answer.size
        while len(self._entries) > self.max_entries or self.chars > self.max_chars:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: str) -> None:
        _, answer = self._entries.pop(key)
        self.chars -= answer.size
