"""Jittered exponential backoff: a pure function of the attempt number and a random draw."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    base: float = 0.5
    factor: float = 2.0
    cap: float = 30.0

    def delay(self, attempt: int, draw: float | None = None) -> float:
        """Delay before retry number ``attempt`` (0-based): uniform in [ceiling/2, ceiling]."""
        ceiling = min(self.cap, self.base * self.factor**attempt)
        u = random.random() if draw is None else draw
        return ceiling * (0.5 + 0.5 * u)

    def failover_delay(self, attempt: int, routers: int, draw: float | None = None) -> float:
        """Delay before retry number ``attempt`` (0-based) when there are ``routers`` to try
        in turn: the next router at once, the backoff once every router was tried."""
        if (attempt + 1) % routers:
            return 0.0
        return self.delay(attempt // routers, draw)
