"""Rate limits shared by every router through Redis.

Same rules and headers as ``interface.py`` (its pure core builds the headers from what the
scripts return); each decision is one atomic Lua script, run with ``EVALSHA``
(redis-py loads a script once and again only if the server forgets it).

* **One clock.** The scripts read Redis's ``TIME``, so routers whose clocks disagree still
  share one window: no router can admit early or late because its clock is off. (Redis 7
  replicates script effects, so reading ``TIME`` before writing is allowed.)
* **Keys** are named in ``redis_queue/keys.rate_limit_keys``: ``{prefix}rl:{<key_id>}:req``
  (a sorted set of requests scored by when they leave the window), ``...:tok`` (the GCRA
  ``tat``) and ``...:streams`` (stream slots). The braces are a Redis Cluster hash tag, so
  a key's three names share a slot and one script may touch them all. Every write sets a
  TTL that ends when the key is idle again, so idle keys vanish.
* **Stream slots are leases**: a sorted set of slot ids scored by expiry. The holder calls
  ``keepalive`` per chunk, which extends the lease at most every third of it; an acquire
  first drops expired slots, so a router that crashed mid-stream frees its slots after
  ``stream_lease_s``. A stream silent for a whole lease loses its slot until its next
  keepalive puts it back (the count is then briefly over the cap rather than wrong).
* **When Redis is unreachable** (refused, reset, slower than ``REDIS_CALL_TIMEOUT_S``, or
  answering with an error such as OOM or READONLY)
  the default, ``ON_REDIS_DOWN = OnRedisDown.LOCAL``, fails open to per-router limits: each
  router enforces the limits in memory, so a key gets at most (routers x limit) until Redis
  is back. Rate limits here protect capacity, not money or secrets (keys are checked
  elsewhere), and refusing every request because a shared counter is down would turn a
  Redis outage into a full outage. ``OnRedisDown.CLOSED`` refuses instead with
  ``RateLimiterUnavailable`` (answer 503). Either way the outage is logged once, its end
  once, and Redis is retried every ``REDIS_RETRY_S`` rather than on every request.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions
from redis.commands.core import AsyncScript
from redis.typing import EncodableT

from shoal.redis_queue.keys import rate_limit_keys
from shoal.router.admission.ratelimit.interface import (
    WINDOW_S,
    Admission,
    RateLimits,
    Snapshot,
    StreamSlot,
    WindowLog,
    rate_headers,
    refusal,
    streams_refusal,
)
from shoal.router.admission.ratelimit.memory import MemoryRateLimiter

log = logging.getLogger(__name__)


class OnRedisDown(enum.Enum):
    LOCAL = "local"  # fail open to limits enforced by each router in memory
    CLOSED = "closed"  # refuse requests with RateLimiterUnavailable


ON_REDIS_DOWN = OnRedisDown.LOCAL
REDIS_CALL_TIMEOUT_S = 0.5  # a limiter slower than this is treated as down
REDIS_RETRY_S = 5.0  # while down, try Redis again this often (one caller at a time)
STREAM_LEASE_S = 60.0  # a crashed router's stream slots are freed after this

# Unreachable, too slow, or refusing (OOM, READONLY after a failover, BUSY): all mean the
# limiter cannot use Redis now. The scripts are tested, so a script error is one of these.
_DOWN_ERRORS = (redis.exceptions.RedisError, OSError, TimeoutError)

# Lua numbers become strings with 14 digits when passed to redis.call, which would cut
# timestamps to 100 us; ``num`` keeps all 17.
_PRELUDE = """
local function num(x) return string.format('%.17g', x) end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# KEYS: req, tok. ARGV: rpm (0 = none), tpm (0 = none), window, reserve, member.
# Returns {admitted, now, count, opens_at, clears_at, tat}: the state after admitting, or as
# found. Requests are scored by when they leave the window, as in the memory limiter.
_ADMIT = (
    _PRELUDE
    + """
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local window, reserve = tonumber(ARGV[3]), tonumber(ARGV[4])
local count, ok = 0, true
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', num(now))
  count = redis.call('ZCARD', KEYS[1])
  if count >= rpm then ok = false end
end
local tat = 0
if tpm > 0 then
  tat = tonumber(redis.call('GET', KEYS[2]) or '0')
  if now < tat - (window - window / tpm) then ok = false end
end
if ok and rpm > 0 then
  redis.call('ZADD', KEYS[1], num(now + window), ARGV[5])
  redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000))
  count = count + 1
end
if ok and tpm > 0 and reserve > 0 then
  tat = math.max(tat, now) + reserve * window / tpm
  redis.call('SET', KEYS[2], num(tat), 'PX', math.max(1, math.ceil((tat - now) * 1000)))
end
local opens, clears = 0, 0
if count > 0 then
  local i = 0
  if count >= rpm then i = count - rpm end
  opens = redis.call('ZRANGE', KEYS[1], i, i, 'WITHSCORES')[2]
  clears = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2]
end
return {ok and 1 or 0, num(now), count, opens, clears, num(tat)}
"""
)

# KEYS: tok. ARGV: tokens (signed correction), tpm, window.
_CHARGE = (
    _PRELUDE
    + """
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
tat = math.max(tat, now) + tonumber(ARGV[1]) * tonumber(ARGV[3]) / tonumber(ARGV[2])
if tat <= now then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], num(tat), 'PX', math.max(1, math.ceil((tat - now) * 1000)))
end
return 1
"""
)

# KEYS: streams. ARGV: max (0 = only refresh), lease, slot id. Returns {taken, open}.
_SLOT = (
    _PRELUDE
    + """
local max, lease = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', num(now))
local open = redis.call('ZCARD', KEYS[1])
if max > 0 and open >= max then return {0, open} end
if redis.call('ZADD', KEYS[1], num(now + lease), ARGV[3]) == 1 then open = open + 1 end
redis.call('PEXPIRE', KEYS[1], math.ceil(lease * 1000))
return {1, open}
"""
)


class RateLimiterUnavailable(Exception):
    """Redis is unreachable and ``OnRedisDown.CLOSED`` says to refuse (answer 503)."""

    def __init__(self, retry_after: float, message: str) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.message = message


@dataclass(frozen=True, slots=True)
class RateLimitKeys:
    req: str
    tok: str
    streams: str


class RedisSlot:
    """A stream slot leased in Redis; ``release`` is idempotent."""

    def __init__(self, limiter: RedisRateLimiter, key: str, slot_id: str) -> None:
        self._limiter = limiter
        self._key = key
        self.slot_id = slot_id
        self._renewed = limiter.monotonic()
        self._released = False

    async def keepalive(self) -> None:
        now = self._limiter.monotonic()
        if self._released or now - self._renewed < self._limiter.stream_lease_s / 3:
            return
        self._renewed = now
        await self._limiter.renew_slot(self._key, self.slot_id)

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        await self._limiter.release_slot(self._key, self.slot_id)


class RedisRateLimiter:
    """``RateLimiter`` shared by all routers that use the same Redis and ``prefix``."""

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        *,
        window_s: float = WINDOW_S,
        stream_lease_s: float = STREAM_LEASE_S,
        on_down: OnRedisDown = ON_REDIS_DOWN,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefix = prefix
        self.window = window_s  # the rule's length; only tests shorten it
        self.stream_lease_s = stream_lease_s
        self.on_down = on_down
        self.monotonic = monotonic
        self.local = MemoryRateLimiter(window_s=window_s)
        self._admit = redis.register_script(_ADMIT)
        self._charge = redis.register_script(_CHARGE)
        self._slot = redis.register_script(_SLOT)
        self._redis = redis
        self._down = False
        self._retry_at = -math.inf

    def keys(self, key_id: str) -> RateLimitKeys:
        """Every Redis key name this limiter uses (named in ``redis_queue/keys``)."""
        req, tok, streams = rate_limit_keys(self.prefix, key_id)
        return RateLimitKeys(req=req, tok=tok, streams=streams)

    @property
    def down(self) -> bool:
        return self._down

    async def admit(self, key_id: str, limits: RateLimits, reserve_tokens: int = 0) -> Admission:
        if not limits.limits_calls:
            return Admission()
        keys = self.keys(key_id)
        reserve = max(0, reserve_tokens) if limits.tokens_per_min is not None else 0
        args = (
            limits.requests_per_min or 0,
            limits.tokens_per_min or 0,
            repr(self.window),
            reserve,
            secrets.token_hex(8),
        )
        reply = await self._run(self._admit, [keys.req, keys.tok], args)
        if reply is None:
            return await self._fallback().admit(key_id, limits, reserve_tokens)
        ok, now, count, opens, clears, tat = reply
        view = WindowLog(count=int(count), opens_at=float(opens), clears_at=float(clears))
        snap = Snapshot(view, float(tat), float(now), self.window)
        if not int(ok):
            raise refusal(key_id, snap, limits, reserve_tokens)
        return Admission(rate_headers(snap, limits), reserve)

    async def charge_tokens(
        self, key_id: str, limits: RateLimits, tokens: int, reserved: int
    ) -> None:
        if limits.tokens_per_min is None or tokens == reserved:
            return
        args = (tokens - reserved, limits.tokens_per_min, repr(self.window))
        reply = await self._run(self._charge, [self.keys(key_id).tok], args)
        if reply is None and self.on_down is OnRedisDown.LOCAL:
            await self.local.charge_tokens(key_id, limits, tokens, reserved)

    async def stream_started(self, key_id: str, limits: RateLimits) -> StreamSlot:
        if limits.max_streams is None:
            return await self.local.stream_started(key_id, limits)
        key, slot_id = self.keys(key_id).streams, secrets.token_hex(8)
        args = (limits.max_streams, repr(self.stream_lease_s), slot_id)
        reply = await self._run(self._slot, [key], args)
        if reply is None:
            return await self._fallback().stream_started(key_id, limits)
        taken, open_streams = (int(x) for x in reply)
        if not taken:
            raise streams_refusal(key_id, open_streams, limits.max_streams)
        return RedisSlot(self, key, slot_id)

    async def renew_slot(self, key: str, slot_id: str) -> None:
        """Extend a slot's lease (re-adding it if it had expired): the stream still runs."""
        await self._run(self._slot, [key], (0, repr(self.stream_lease_s), slot_id))

    async def release_slot(self, key: str, slot_id: str) -> None:
        """Free a slot; if Redis is down its lease frees it later."""
        await self._run(None, [key], (slot_id,))

    # ------------------------------------------------------------ Redis health

    def _fallback(self) -> MemoryRateLimiter:
        if self.on_down is OnRedisDown.CLOSED:
            raise RateLimiterUnavailable(
                max(1.0, self._retry_at - self.monotonic()),
                "The rate limiter's Redis is unreachable, so requests are refused for now; "
                "retry shortly, and operators: check Redis (see the router log).",
            )
        return self.local

    async def _run(
        self, script: AsyncScript | None, keys: list[str], args: Sequence[EncodableT]
    ) -> list[Any] | None:
        """One Redis call, or None when Redis is unreachable (then logged once per outage).

        ``script=None`` means ZREM (a single command needs no script).
        """
        now = self.monotonic()
        if now < self._retry_at:
            return None
        if self._down:
            self._retry_at = now + REDIS_RETRY_S  # this caller probes; the others go local
        try:
            async with asyncio.timeout(REDIS_CALL_TIMEOUT_S):
                if script is None:
                    await self._redis.zrem(keys[0], *args)
                    reply: list[Any] = []
                else:
                    reply = await script(keys=keys, args=args)
        except _DOWN_ERRORS as exc:
            self._mark_down(exc)
            return None
        self._mark_up()
        return reply

    def _mark_down(self, exc: BaseException) -> None:
        self._retry_at = self.monotonic() + REDIS_RETRY_S
        if self._down:
            return
        self._down = True
        mode = (
            "each router now enforces the limits alone, in memory"
            if self.on_down is OnRedisDown.LOCAL
            else "requests are refused (on_down=closed)"
        )
        log.warning(
            "rate limiter: Redis is unreachable (%s: %s); %s until it is back, retrying every %ss",
            type(exc).__name__,
            exc,
            mode,
            REDIS_RETRY_S,
        )

    def _mark_up(self) -> None:
        if self._down:
            self._down = False
            self._retry_at = -math.inf
            log.info("rate limiter: Redis is reachable again; limits are shared again")

    async def close(self) -> None:
        """Close this limiter's Redis connections."""
        await self._redis.aclose()
