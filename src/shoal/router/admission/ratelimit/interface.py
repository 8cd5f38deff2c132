"""Per-key rate limits: requests per minute, tokens per minute and concurrent streams.

Two algorithms, one per kind of limit, each chosen for what that limit must promise:

* **Requests per minute: a sliding-window log.** A request is known when it arrives, so the
  limit can be exact: a key never gets more than ``requests_per_min`` admissions in any
  minute (any half-open window of ``WINDOW_S``). GCRA or a token bucket with a burst of N
  cannot promise that: a full bucket plus a minute of refill lets ``2N - 1`` through in one
  minute, and a bucket without a burst (OpenAI's "quantized" limits) makes two simultaneous
  requests at 10/min wait 6 s. The log keeps when each request still in the window leaves
  it (at most ``requests_per_min`` times per key), and the wait is exact: until the request
  that makes room leaves. Counting and waiting both compare those expiry times with ``now``,
  so float rounding can never admit a request while reporting a wait, or the reverse.
* **Tokens per minute: GCRA** (a token bucket with a burst of one minute's budget, stored as
  one number, the "theoretical arrival time" ``tat``). Tokens are known only when the answer
  ends, and the charge is a signed correction of the reservation made at admission; a
  bucket absorbs any correction in O(1), where a log would have to find and rewrite the
  reservation. A request is admitted while at least one token of budget is left; the real
  usage is charged at the end and may push the budget into debt, so later requests wait
  until the debt is repaid at ``tokens_per_min``. One number means one Redis string whose
  TTL is exactly "until this key is idle again".

Headers follow OpenAI's (``x-ratelimit-limit-*``, ``-remaining-*``, ``-reset-*``). While a
limit has budget left, ``reset`` is the time until it is fully replenished (OpenAI's
meaning); once ``remaining`` is 0 it is the exact time until that limit admits again, so on
a 429 it equals the precise ``retry-after-ms`` (which the ``openai`` client prefers) and
``Retry-After`` is the same rounded up to whole seconds. Durations are written like
OpenAI's ("820ms", "1s", "6m0s"), rounded up to the millisecond so waiting that long works.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from shoal.keys.records import KeyLimits

log = logging.getLogger(__name__)

WINDOW_S = 60.0  # the rule's length: "per minute"
STREAM_RETRY_AFTER_S = 1.0  # a stream's end cannot be predicted; suggest polling this often
_EPS = 1e-9  # absorbs float noise when turning a real budget into whole tokens


RateLimits = KeyLimits
"""A key's limits (``None``: unlimited), as the key store keeps them."""


class RateLimited(Exception):
    """A key is over a limit; answer 429 with ``headers`` (they include ``Retry-After``)."""

    code = "rate_limit_exceeded"

    def __init__(
        self, retry_after: float, headers: dict[str, str], message: str, *, reason: str
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.headers = headers
        self.message = message
        self.reason = reason  # "requests", "tokens" or "streams"


@dataclass(frozen=True, slots=True)
class Admission:
    """An admitted request: add ``headers`` to the response; charge against ``reserved_tokens``."""

    headers: Mapping[str, str] = field(default_factory=dict)
    reserved_tokens: int = 0


class StreamSlot(Protocol):
    async def keepalive(self) -> None:
        """Say the stream still runs (cheap; call it per chunk)."""

    async def release(self) -> None:
        """Free the slot; calling it again does nothing."""


class RateLimiter(Protocol):
    async def admit(self, key_id: str, limits: RateLimits, reserve_tokens: int = 0) -> Admission:
        """Admit one request or raise ``RateLimited``."""

    async def charge_tokens(
        self, key_id: str, limits: RateLimits, tokens: int, reserved: int
    ) -> None:
        """Charge a finished job's real ``tokens`` in place of the ``reserved`` estimate."""

    async def stream_started(self, key_id: str, limits: RateLimits) -> StreamSlot:
        """Take a stream slot or raise ``RateLimited`` when ``max_streams`` are open."""

    async def close(self) -> None:
        """Release what the limiter holds (connections); called once when the router stops."""


# ---------------------------------------------------------------- the pure core


@dataclass(frozen=True, slots=True)
class WindowLog:
    """The request log of one key as seen at some ``now``: the requests still counted.

    ``opens_at`` is when the request whose leaving brings ``count`` below the limit leaves
    (the ``count - limit``-th oldest's expiry; it only matters when ``count >= limit``);
    ``clears_at`` is when the newest leaves.
    """

    count: int = 0
    opens_at: float = 0.0
    clears_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a decision about one key needs: its state and the time."""

    log: WindowLog
    tat: float
    now: float
    window: float = WINDOW_S


def window_wait(log: WindowLog, limit: int, now: float) -> float:
    """Seconds until the log admits a request (0 = now)."""
    return 0.0 if log.count < limit else max(0.0, log.opens_at - now)


def gcra_wait(tat: float, limit: int, window: float, now: float) -> float:
    """Seconds until at least one token of budget is back (0 = now).

    GCRA with emission interval ``T = window / limit`` and tolerance ``window - T``: a full
    minute's budget may be spent at once, and one token more is back every ``T``.
    """
    return max(0.0, tat - (window - window / limit) - now)


def gcra_charge(tat: float, tokens: float, limit: int, window: float, now: float) -> float:
    """The new ``tat`` after charging ``tokens`` (negative refunds, never below ``now``)."""
    return max(now, max(tat, now) + tokens * window / limit)


def gcra_spent(tat: float, limit: int, window: float, now: float) -> float:
    """Tokens of this window's budget in use (may exceed ``limit``: debt)."""
    return max(0.0, tat - now) * limit / window


def admission_wait(snap: Snapshot, limits: RateLimits) -> float:
    """Exact seconds until a request is admitted; 0 means admit now."""
    wait = 0.0
    if limits.requests_per_min is not None:
        wait = window_wait(snap.log, limits.requests_per_min, snap.now)
    if limits.tokens_per_min is not None:
        wait = max(wait, gcra_wait(snap.tat, limits.tokens_per_min, snap.window, snap.now))
    return wait


def format_duration(seconds: float) -> str:
    """OpenAI's (Go's) duration format, rounded up to the millisecond: "820ms", "6m0s"."""
    ms = max(0, math.ceil(round(seconds * 1000, 6)))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, frac = divmod(rest, 1000)
    text = f"{secs}.{frac:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text


def retry_headers(wait: float) -> dict[str, str]:
    """``Retry-After`` (whole seconds, at least 1) and the precise ``retry-after-ms``."""
    return {
        "Retry-After": str(max(1, math.ceil(round(wait, 9)))),
        "retry-after-ms": str(max(1, math.ceil(round(wait * 1000, 6)))),
    }


def _request_headers(snap: Snapshot, limit: int) -> dict[str, str]:
    log_, now = snap.log, snap.now
    wait = window_wait(log_, limit, now)
    remaining = 0 if wait > 0 else max(0, limit - log_.count)
    reset = wait if remaining == 0 else max(0.0, log_.clears_at - now)
    return {
        "x-ratelimit-limit-requests": str(limit),
        "x-ratelimit-remaining-requests": str(remaining),
        "x-ratelimit-reset-requests": format_duration(reset),
    }


def _token_headers(snap: Snapshot, limit: int) -> dict[str, str]:
    wait = gcra_wait(snap.tat, limit, snap.window, snap.now)
    spent = gcra_spent(snap.tat, limit, snap.window, snap.now)
    remaining = 0 if wait > 0 else max(1, math.floor(limit - spent + _EPS))
    reset = wait if wait > 0 else max(0.0, snap.tat - snap.now)
    return {
        "x-ratelimit-limit-tokens": str(limit),
        "x-ratelimit-remaining-tokens": str(remaining),
        "x-ratelimit-reset-tokens": format_duration(reset),
    }


def rate_headers(snap: Snapshot, limits: RateLimits) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers for a key in state ``snap``."""
    headers: dict[str, str] = {}
    if limits.requests_per_min is not None:
        headers.update(_request_headers(snap, limits.requests_per_min))
    if limits.tokens_per_min is not None:
        headers.update(_token_headers(snap, limits.tokens_per_min))
    return headers


def refusal(key_id: str, snap: Snapshot, limits: RateLimits, reserve: int) -> RateLimited:
    """The ``RateLimited`` for a request refused in state ``snap``."""
    wait = max(admission_wait(snap, limits), 0.001)
    parts, reason = [], "tokens"
    rpm, tpm = limits.requests_per_min, limits.tokens_per_min
    if rpm is not None and window_wait(snap.log, rpm, snap.now) > 0:
        parts.append(f"requests per min (RPM): Limit {rpm}, Used {snap.log.count}, Requested 1")
        reason = "requests"
    if tpm is not None and gcra_wait(snap.tat, tpm, snap.window, snap.now) > 0:
        used = math.ceil(gcra_spent(snap.tat, tpm, snap.window, snap.now) - _EPS)
        parts.append(f"tokens per min (TPM): Limit {tpm}, Used {used}, Requested {reserve}")
    message = (
        f"Rate limit reached for API key {key_id} on {'; and on '.join(parts) or 'its limits'}. "
        f"Please try again in {format_duration(wait)}, or ask the operator for a higher limit."
    )
    headers = {**retry_headers(wait), **rate_headers(snap, limits)}
    return RateLimited(wait, headers, message, reason=reason)


def streams_refusal(key_id: str, open_streams: int, limit: int) -> RateLimited:
    streams = f"{open_streams} stream{'' if open_streams == 1 else 's'}"
    message = (
        f"API key {key_id} already has {streams} open and may have {limit} at once; wait for "
        "one to finish, or ask the operator for a higher max_streams."
    )
    return RateLimited(
        STREAM_RETRY_AFTER_S, retry_headers(STREAM_RETRY_AFTER_S), message, reason="streams"
    )
