"""Rate limits enforced by one router, in its memory (without ``--redis-url``).

The rules and headers are ``interface.py``'s pure core; ``redis.py`` is the sibling shared
through Redis.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.router.admission.ratelimit.interface import (
    WINDOW_S,
    Admission,
    RateLimits,
    Snapshot,
    StreamSlot,
    WindowLog,
    admission_wait,
    gcra_charge,
    rate_headers,
    refusal,
    streams_refusal,
)


@dataclass(eq=False, slots=True)
class _KeyState:
    expiries: deque[float] = field(default_factory=deque)  # admission + window, oldest first
    tat: float = -math.inf
    streams: int = 0

    def prune(self, now: float) -> None:
        while self.expiries and self.expiries[0] <= now:
            self.expiries.popleft()

    def view(self, limit: int | None = None) -> WindowLog:
        if not self.expiries:
            return WindowLog()
        n = len(self.expiries)
        opens = self.expiries[n - limit] if limit is not None and n >= limit else self.expiries[0]
        return WindowLog(count=n, opens_at=opens, clears_at=self.expiries[-1])

    def idle(self, now: float) -> bool:
        return not self.expiries and self.tat <= now and self.streams == 0


class MemorySlot:
    """A stream slot of one router; ``release`` is idempotent."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    async def keepalive(self) -> None:
        return None

    async def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class MemoryRateLimiter:
    """Limits enforced by one router. Each method runs without awaiting, so it is atomic."""

    def __init__(
        self, *, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window = window_s  # the rule's length; only tests shorten it
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}
        self._next_sweep = clock() + window_s

    def snapshot(self, key_id: str, limits: RateLimits) -> Snapshot:
        """The state of ``key_id`` now (read-only; for tests and metrics)."""
        now = self._clock()
        state = self._keys.get(key_id, _KeyState())
        state.prune(now)
        return Snapshot(state.view(limits.requests_per_min), state.tat, now, self.window)

    def active_keys(self) -> int:
        """How many keys have state (idle ones are dropped once a window)."""
        return len(self._keys)

    async def admit(self, key_id: str, limits: RateLimits, reserve_tokens: int = 0) -> Admission:
        if not limits.limits_calls:
            return Admission()
        now = self._clock()
        self._sweep(now)
        state = self._keys.setdefault(key_id, _KeyState())
        state.prune(now)
        snap = Snapshot(state.view(limits.requests_per_min), state.tat, now, self.window)
        if admission_wait(snap, limits) > 0:
            raise refusal(key_id, snap, limits, reserve_tokens)
        if limits.requests_per_min is not None:
            state.expiries.append(now + self.window)
        reserved = 0
        if limits.tokens_per_min is not None and reserve_tokens > 0:
            reserved = reserve_tokens
            state.tat = gcra_charge(state.tat, reserved, limits.tokens_per_min, self.window, now)
        after = Snapshot(state.view(limits.requests_per_min), state.tat, now, self.window)
        return Admission(rate_headers(after, limits), reserved)

    async def charge_tokens(
        self, key_id: str, limits: RateLimits, tokens: int, reserved: int
    ) -> None:
        if limits.tokens_per_min is None or tokens == reserved:
            return
        now = self._clock()
        state = self._keys.setdefault(key_id, _KeyState())
        state.tat = gcra_charge(
            state.tat, tokens - reserved, limits.tokens_per_min, self.window, now
        )

    async def stream_started(self, key_id: str, limits: RateLimits) -> StreamSlot:
        if limits.max_streams is None:
            return MemorySlot(lambda: None)
        state = self._keys.setdefault(key_id, _KeyState())
        if state.streams >= limits.max_streams:
            raise streams_refusal(key_id, state.streams, limits.max_streams)
        state.streams += 1

        def release() -> None:
            state.streams -= 1

        return MemorySlot(release)

    def _sweep(self, now: float) -> None:
        """Forget idle keys, at most once a window, so memory follows active keys only."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.window
        for state in self._keys.values():
            state.prune(now)
        idle = [k for k, s in self._keys.items() if s.idle(now)]
        for key_id in idle:
            del self._keys[key_id]

    async def close(self) -> None:
        """Nothing to release: the state is this process's memory."""
