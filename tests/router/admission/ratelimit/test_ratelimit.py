"""The pure rate-limit core and the in-process limiter, on a clock the tests move by hand."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shoal.router.admission.ratelimit.interface import (
    WINDOW_S,
    RateLimited,
    RateLimits,
    Snapshot,
    WindowLog,
    admission_wait,
    format_duration,
    gcra_charge,
    gcra_wait,
    rate_headers,
    retry_headers,
    streams_refusal,
    window_wait,
)
from shoal.router.admission.ratelimit.memory import MemoryRateLimiter


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def parse_duration(text: str) -> float:
    """Inverse of OpenAI's duration format, as a client would read it."""
    if text.endswith("ms"):
        return int(text[:-2]) / 1000
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?([\d.]+)s", text)
    assert m, text
    hours, minutes, secs = m.groups()
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(secs)


async def admitted(lim: MemoryRateLimiter, limits: RateLimits, reserve: int = 0) -> bool:
    try:
        await lim.admit("k", limits, reserve)
    except RateLimited:
        return False
    return True


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-1, "0s"),
        (0.0001, "1ms"),
        (0.3, "300ms"),  # 0.3 * 1000 is 300.00000000000006: no spurious extra millisecond
        (0.82, "820ms"),
        (1, "1s"),
        (1.0004, "1.001s"),  # rounded up: waiting that long is enough
        (8.64, "8.64s"),
        (60, "1m0s"),
        (90.5, "1m30.5s"),
        (360, "6m0s"),
        (3600, "1h0m0s"),
        (3723.25, "1h2m3.25s"),
    ],
)
def test_format_duration_like_openai(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@given(st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_format_duration_is_never_short_and_at_most_a_millisecond_long(seconds: float) -> None:
    back = parse_duration(format_duration(seconds))
    assert seconds - 1e-9 <= back < seconds + 0.001 + 1e-9


@pytest.mark.parametrize(
    ("wait", "after", "after_ms"),
    [(0.2, "1", "200"), (1.0, "1", "1000"), (1.0001, "2", "1001"), (57.3, "58", "57300")],
)
def test_retry_headers_round_up(wait: float, after: str, after_ms: str) -> None:
    assert retry_headers(wait) == {"Retry-After": after, "retry-after-ms": after_ms}


def test_limits_refuse_zero_with_a_hint() -> None:
    with pytest.raises(ValueError, match="disable the key"):
        RateLimits(requests_per_min=0)
    assert not RateLimits(max_streams=1).limits_calls


# ---------------------------------------------------------------- pure decisions


@pytest.mark.parametrize(
    ("log", "limit", "now", "wait"),
    [
        (WindowLog(), 3, 5.0, 0.0),
        (WindowLog(count=2, opens_at=60.0, clears_at=62.0), 3, 5.0, 0.0),
        (WindowLog(count=3, opens_at=61.0, clears_at=62.0), 3, 5.0, 56.0),  # until one leaves
        (WindowLog(count=3, opens_at=61.0, clears_at=62.0), 3, 61.0, 0.0),  # it leaves then
    ],
)
def test_window_wait(log: WindowLog, limit: int, now: float, wait: float) -> None:
    assert window_wait(log, limit, now) == pytest.approx(wait)


async def test_a_lowered_request_limit_waits_for_enough_requests_to_leave() -> None:
    clock = Clock(0.0)
    lim = MemoryRateLimiter(clock=clock)
    for t in range(5):
        clock.now = float(t)
        await lim.admit("k", RateLimits(requests_per_min=5))
    clock.now = 10.0
    with pytest.raises(RateLimited) as refused:
        await lim.admit("k", RateLimits(requests_per_min=2))
    assert refused.value.retry_after == pytest.approx(53.0)  # the 4th oldest leaves at 63


@pytest.mark.parametrize(
    ("tat", "limit", "now", "wait"),
    [
        (-math.inf, 60, 0.0, 0.0),  # never used
        (59.0, 60, 0.0, 0.0),  # 59 of 60 tokens spent: one left
        (60.0, 60, 0.0, 1.0),  # all spent: one token back per second
        (120.0, 60, 0.0, 61.0),  # 60 tokens of debt on top
        (120.0, 60, 61.0, 0.0),
    ],
)
def test_gcra_wait(tat: float, limit: int, now: float, wait: float) -> None:
    assert gcra_wait(tat, limit, 60.0, now) == pytest.approx(wait)


def test_gcra_charge_refund_never_banks_credit() -> None:
    assert gcra_charge(-math.inf, 30, 60, 60.0, 10.0) == 40.0
    assert gcra_charge(40.0, -20, 60, 60.0, 10.0) == 20.0
    assert gcra_charge(40.0, -100, 60, 60.0, 10.0) == 10.0  # not below now
    assert gcra_charge(5.0, 1, 60, 60.0, 10.0) == 11.0  # repaid debt is not remembered


def test_headers_reset_means_full_while_budget_is_left_and_next_admission_once_out() -> None:
    limits = RateLimits(requests_per_min=2, tokens_per_min=600)
    snap = Snapshot(WindowLog(count=1, opens_at=70.0, clears_at=70.0), tat=16.0, now=10.0)
    assert rate_headers(snap, limits) == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "1m0s",  # until the one counted request leaves
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "540",
        "x-ratelimit-reset-tokens": "6s",  # until the 60 spent tokens are back
    }
    out = Snapshot(WindowLog(count=2, opens_at=70.0, clears_at=90.0), tat=100.0, now=40.0)
    headers = rate_headers(out, limits)
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == "30s"  # the 10.0 request leaves at 70
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    assert headers["x-ratelimit-reset-tokens"] == "100ms"  # one token back: 100 - 59.9 - 40
    assert admission_wait(out, limits) == pytest.approx(30.0)


# ---------------------------------------------------------------- memory limiter


async def test_admission_headers_refusal_and_exact_retry() -> None:
    clock = Clock(0.0)
    lim = MemoryRateLimiter(clock=clock)
    limits = RateLimits(requests_per_min=2)
    assert (await lim.admit("k", RateLimits())).headers == {}  # unlimited: no headers
    first = await lim.admit("k", limits, reserve_tokens=500)
    assert first.reserved_tokens == 0  # no token limit, nothing reserved
    assert set(first.headers) == {
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    }
    clock.now = 15.0
    await lim.admit("k", limits)
    clock.now = 20.0
    with pytest.raises(RateLimited) as refused:
        await lim.admit("k", limits)
    err = refused.value
    assert err.retry_after == pytest.approx(40.0) and err.reason == "requests"
    assert err.headers["Retry-After"] == "40" and err.headers["retry-after-ms"] == "40000"
    assert err.headers["x-ratelimit-reset-requests"] == "40s"
    assert "Limit 2, Used 2" in err.message and "try again in 40s" in err.message
    assert await lim.admit("other", limits)  # keys are independent
    clock.now = 60.0 - 1e-6
    assert not await admitted(lim, limits)
    clock.now = 60.0
    assert await admitted(lim, limits)


async def test_tokens_reserve_then_charge_actual_usage() -> None:
    clock = Clock(0.0)
    lim = MemoryRateLimiter(clock=clock)
    limits = RateLimits(tokens_per_min=600)  # 10 tokens a second
    adm = await lim.admit("k", limits, reserve_tokens=600)
    assert adm.reserved_tokens == 600 and adm.headers["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(RateLimited) as refused:
        await lim.admit("k", limits, reserve_tokens=10)
    assert refused.value.reason == "tokens" and refused.value.retry_after == pytest.approx(0.1)
    await lim.charge_tokens("k", limits, tokens=100, reserved=600)  # the answer was short
    assert lim.snapshot("k", limits).tat == pytest.approx(10.0)
    assert (await lim.admit("k", limits)).headers["x-ratelimit-remaining-tokens"] == "500"
    await lim.charge_tokens("k", limits, tokens=1700, reserved=0)  # a long one: 1200 in debt
    with pytest.raises(RateLimited) as refused:
        await lim.admit("k", limits)
    assert refused.value.retry_after == pytest.approx(120.1)  # 1201 tokens to repay at 10/s
    assert "Used 1800" in refused.value.message
    assert refused.value.headers["x-ratelimit-reset-tokens"] == "2m0.1s"
    await lim.charge_tokens("k", RateLimits(requests_per_min=1), tokens=10**6, reserved=0)
    assert lim.snapshot("k", limits).tat == pytest.approx(180.0)  # no token limit: no charge


async def test_streams_cap_and_idempotent_release() -> None:
    lim = MemoryRateLimiter()
    limits = RateLimits(max_streams=2)
    a = await lim.stream_started("k", limits)
    b = await lim.stream_started("k", limits)
    with pytest.raises(RateLimited) as refused:
        await lim.stream_started("k", limits)
    assert refused.value.reason == "streams" and refused.value.headers["Retry-After"] == "1"
    assert "already has 2 streams open" in refused.value.message
    assert "already has 1 stream open" in streams_refusal("k", 1, 1).message
    await a.release()
    await a.release()  # a second release must not free b's slot
    c = await lim.stream_started("k", limits)
    with pytest.raises(RateLimited):
        await lim.stream_started("k", limits)
    for slot in (b, c):
        await slot.keepalive()
        await slot.release()
    await (await lim.stream_started("k", RateLimits())).release()  # unlimited


async def test_idle_keys_are_forgotten() -> None:
    clock = Clock(0.0)
    lim = MemoryRateLimiter(clock=clock)
    limits = RateLimits(requests_per_min=5, tokens_per_min=100)
    for key in ("a", "b"):
        await lim.admit(key, limits, reserve_tokens=150)  # 50 tokens of debt: 90 s to repay
    slot = await lim.stream_started("c", RateLimits(max_streams=1))
    assert lim.active_keys() == 3
    clock.now = 61.0
    await lim.admit("d", RateLimits(requests_per_min=1))
    assert lim.active_keys() == 4  # a, b still owe tokens; c streams
    clock.now = 200.0
    await lim.admit("d", RateLimits(requests_per_min=1))
    assert lim.active_keys() == 2  # c (streaming) and d (just admitted)
    await slot.release()


# ---------------------------------------------------------------- properties

gaps = st.lists(st.floats(min_value=0, max_value=30, allow_nan=False), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(gaps=gaps, limit=st.integers(1, 8))
async def test_requests_never_exceed_the_limit_in_any_window(gaps: list[float], limit: int) -> None:
    clock = Clock(0.0)
    lim = MemoryRateLimiter(clock=clock)
    limits = RateLimits(requests_per_min=limit)
    times: list[float] = []
    for gap in gaps:
        clock.now += gap
        in_window = sum(1 for t in times if t + WINDOW_S > clock.now)
        ok = await admitted(lim, limits)
        assert ok == (in_window < limit)  # exactly the oracle: never refuses needlessly
        if ok:
            times.append(clock.now)
    for start in times:
        assert sum(1 for t in times if start <= t < start + WINDOW_S) <= limit


async def check_wait_is_exact(lim: MemoryRateLimiter, clock: Clock, limits: RateLimits) -> None:
    """If the key is refused now, it is refused until just before the wait, admitted at it."""
    now = clock.now
    wait = admission_wait(lim.snapshot("k", limits), limits)
    if wait == 0:
        return
    try:
        await lim.admit("k", limits)
    except RateLimited as err:
        # a refusal never says "retry in under a millisecond" (``refusal`` floors it at 1 ms)
        assert err.retry_after == pytest.approx(max(wait, 0.001))
        assert err.headers["retry-after-ms"] == str(max(1, math.ceil(round(wait * 1000, 6))))
    else:
        raise AssertionError("admitted although the wait is positive")
    if wait > 1e-6:
        clock.now = now + wait - 1e-6
        assert admission_wait(lim.snapshot("k", limits), limits) > 0
    clock.now = now + wait + 1e-9
    assert admission_wait(lim.snapshot("k", limits), limits) == 0
    clock.now = now


ops = st.lists(
    st.tuples(
        st.floats(min_value=0, max_value=20, allow_nan=False),  # time since the last step
        st.integers(0, 300),  # tokens reserved at admission
        st.integers(0, 300),  # tokens actually used
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, tpm=st.integers(1, 500), rpm=st.none() | st.integers(1, 6))
async def test_tokens_follow_a_refilling_bucket_and_waits_are_exact(
    ops: list[tuple[float, int, int]], tpm: int, rpm: int | None
) -> None:
    """GCRA against the naive model: a bucket of ``tpm`` tokens refilled at tpm/min."""
    clock = Clock(0.0)
    lim = MemoryRateLimiter(clock=clock)
    limits = RateLimits(requests_per_min=rpm, tokens_per_min=tpm)
    level, last = float(tpm), 0.0
    for gap, reserve, used in ops:
        clock.now += gap
        level = min(tpm, level + (clock.now - last) * tpm / WINDOW_S)
        last = clock.now
        assume(abs(level - 1) > 1e-6)  # floats may round either way exactly at the edge
        await check_wait_is_exact(lim, clock, limits)
        expect_tokens = level >= 1
        try:
            adm = await lim.admit("k", limits, reserve)
        except RateLimited as err:
            assert not expect_tokens or err.reason == "requests"
            continue
        assert expect_tokens
        assert adm.reserved_tokens == reserve
        level = min(tpm, level - used)  # the reservation, corrected by the real usage
        await lim.charge_tokens("k", limits, used, reserve)
        remaining = lim.snapshot("k", limits)
        assert gcra_wait(remaining.tat, tpm, WINDOW_S, clock.now) == pytest.approx(
            max(0.0, (1 - level) * WINDOW_S / tpm), abs=1e-6
        )
