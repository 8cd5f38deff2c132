"""The router's memory of keys it has checked: hash -> record, or "no such key".

Dropped whole whenever any key changes anywhere (watch.py says when). A generation number
guards the race where a database read starts before a change and finishes after the cache
was dropped: ``put`` ignores results read under an older generation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shoal.keys.records import KeyRecord

log = logging.getLogger(__name__)

MAX_UNKNOWN = 10_000  # remembered wrong keys; the oldest is forgotten first


@dataclass(frozen=True)
class Entry:
    """A stored key as verify needs it: the record and its hash."""

    hash: str
    record: KeyRecord


class KeyCache:
    def __init__(self, max_unknown: int = MAX_UNKNOWN) -> None:
        self._known: dict[str, Entry] = {}
        self._unknown: dict[str, None] = {}  # insertion-ordered set of hashes of no key
        self._max_unknown = max_unknown
        self.generation = 0

    def __len__(self) -> int:
        return len(self._known) + len(self._unknown)

    def lookup(self, digest: str) -> tuple[bool, Entry | None]:
        """(found, entry): found with None means "known not to be a key"."""
        entry = self._known.get(digest)
        if entry is not None:
            return True, entry
        return digest in self._unknown, None

    def put(self, digest: str, entry: Entry | None, generation: int) -> bool:
        """Remember a database answer read under ``generation``; False if it is stale."""
        if generation != self.generation:
            return False
        if entry is not None:
            self._known[digest] = entry
            return True
        self._unknown[digest] = None
        if len(self._unknown) > self._max_unknown:
            del self._unknown[next(iter(self._unknown))]
        return True

    def clear(self, reason: str) -> None:
        if self._known or self._unknown:
            log.debug("key cache dropped (%d entries): %s", len(self), reason)
        self._known.clear()
        self._unknown.clear()
        self.generation += 1
