"""Rate limits shared through the real Redis at 127.0.0.1:6379.

Each test run uses its own key prefix and deletes its keys afterwards (SCAN, never KEYS).
Two ``RedisRateLimiter`` instances, each with its own Redis connection pool, stand for two
routers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from shoal.router.admission.ratelimit import redis as ratelimit_redis
from shoal.router.admission.ratelimit.interface import RateLimited, RateLimits
from shoal.router.admission.ratelimit.redis import (
    OnRedisDown,
    RateLimiterUnavailable,
    RedisRateLimiter,
    RedisSlot,
)

RUN_PREFIX = f"shoal-test-{uuid.uuid4().hex[:8]}:"
LOG = "shoal.router.admission.ratelimit.redis"

Factory = Callable[..., Awaitable[RedisRateLimiter]]


def client(port: int = 6379) -> aioredis.Redis:
    return aioredis.Redis(host="127.0.0.1", port=port)


def free_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    prefix = f"{RUN_PREFIX}{uuid.uuid4().hex[:6]}:"
    yield prefix
    r = client()
    try:
        async for key in r.scan_iter(match=f"{prefix}*", count=500):
            await r.delete(key)
    finally:
        await r.aclose()


@pytest.fixture
async def router(prefix: str) -> AsyncIterator[Factory]:
    """Makes "routers": limiters with their own Redis client, closed afterwards."""
    clients: list[aioredis.Redis] = []

    async def make(port: int = 6379, **kwargs: Any) -> RedisRateLimiter:
        clients.append(client(port))
        return RedisRateLimiter(clients[-1], prefix, **kwargs)

    yield make
    for c in clients:
        await c.aclose()


async def server_time(limiter: RedisRateLimiter) -> float:
    s, us = await limiter._redis.time()
    return float(s) + us / 1e6


async def admitted(limiter: RedisRateLimiter, limits: RateLimits, reserve: int = 0) -> bool:
    try:
        await limiter.admit("k", limits, reserve)
    except RateLimited:
        return False
    return True


def test_key_names_come_from_the_prefix() -> None:
    limiter = RedisRateLimiter(client(), "shoal:")
    keys = limiter.keys("key_1")
    assert (keys.req, keys.tok, keys.streams) == (
        "shoal:rl:{key_1}:req",
        "shoal:rl:{key_1}:tok",
        "shoal:rl:{key_1}:streams",
    )


async def test_two_routers_share_one_limit_exactly(router: Factory) -> None:
    a, b = await router(), await router()
    limits = RateLimits(requests_per_min=5)
    results = [await admitted(x, limits) for x in (a, b, a, b, b, a, b)]
    assert results == [True] * 5 + [False] * 2


async def test_racing_routers_admit_exactly_the_limit(
    router: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 30 admissions at once on a busy 2-core machine can take longer than the 0.5 s after
    # which a limiter counts Redis as down (and lets requests through): that is another test.
    monkeypatch.setattr(ratelimit_redis, "REDIS_CALL_TIMEOUT_S", 10.0)
    a, b = await router(), await router()
    limits = RateLimits(requests_per_min=7)
    outcomes = await asyncio.gather(*(admitted(x, limits) for x in (a, b) * 15))
    assert sum(outcomes) == 7


async def test_tokens_are_shared_and_charged_after_the_answer(router: Factory) -> None:
    a, b = await router(), await router()
    limits = RateLimits(tokens_per_min=600)  # 10 tokens a second
    adm = await a.admit("k", limits, reserve_tokens=100)
    assert adm.reserved_tokens == 100
    assert adm.headers["x-ratelimit-remaining-tokens"] == "500"
    await a.charge_tokens("k", limits, tokens=1100, reserved=100)  # 500 tokens of debt
    with pytest.raises(RateLimited) as refused:
        await b.admit("k", limits)
    err = refused.value
    assert err.reason == "tokens"
    assert 50.0 < err.retry_after <= 50.1  # 501 tokens to repay at 10/s, minus a little time
    assert err.headers["Retry-After"] == "51"
    assert math.isclose(int(err.headers["retry-after-ms"]) / 1000, err.retry_after, abs_tol=1e-3)
    await b.charge_tokens("k", limits, tokens=0, reserved=1100)  # a refund clears the debt
    assert (await b.admit("k", limits)).headers["x-ratelimit-remaining-tokens"] == "600"


async def test_headers_and_an_exact_retry_after_over_real_time(router: Factory) -> None:
    a, b = await router(window_s=1.0), await router(window_s=1.0)
    limits = RateLimits(requests_per_min=2)
    first = await a.admit("k", limits)
    assert first.headers == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "1s",
    }
    await b.admit("k", limits)
    with pytest.raises(RateLimited) as refused:
        await a.admit("k", limits)
    err = refused.value
    wait_ms = int(err.headers["retry-after-ms"])
    assert 500 < wait_ms <= 1000 and err.headers["Retry-After"] == "1"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    reset = err.headers["x-ratelimit-reset-requests"]
    assert reset == (f"{wait_ms}ms" if wait_ms < 1000 else "1s")  # the same wait, precisely
    started = time.monotonic()
    await asyncio.sleep(max(0.0, wait_ms / 1000 - 0.25))
    assert not await admitted(b, limits)  # still inside the window
    await asyncio.sleep(wait_ms / 1000 - (time.monotonic() - started) + 0.005)
    assert await admitted(b, limits)  # the header's wait was enough


async def test_every_key_has_a_ttl(router: Factory, prefix: str) -> None:
    a = await router(window_s=30.0, stream_lease_s=45.0)
    limits = RateLimits(requests_per_min=3, tokens_per_min=100, max_streams=2)
    await a.admit("k", limits, reserve_tokens=50)
    slot = await a.stream_started("k", limits)
    r = a._redis
    keys = [key async for key in r.scan_iter(match=f"{prefix}*")]
    assert len(keys) == 3
    for key in keys:
        assert 0 < await r.pttl(key) <= 45_000, key
    await slot.release()


async def test_streams_are_capped_across_routers(router: Factory) -> None:
    a, b = await router(), await router()
    limits = RateLimits(max_streams=3)
    s1, s2 = await a.stream_started("k", limits), await a.stream_started("k", limits)
    s3 = await b.stream_started("k", limits)
    for limiter in (a, b):
        with pytest.raises(RateLimited) as refused:
            await limiter.stream_started("k", limits)
        assert refused.value.reason == "streams" and "3 streams open" in refused.value.message
    await s1.release()
    await s1.release()  # idempotent: frees one slot, not two
    s4 = await b.stream_started("k", limits)
    with pytest.raises(RateLimited):
        await a.stream_started("k", limits)
    for slot in (s2, s3, s4):
        await slot.release()
    assert await a._redis.exists(a.keys("k").streams) == 0


async def test_a_crashed_holder_is_expired_after_its_lease(router: Factory) -> None:
    crashed = await router(stream_lease_s=0.5)
    other = await router()  # a live router with the default, long lease
    limits = RateLimits(max_streams=2)
    await crashed.stream_started("k", limits)  # never released: its router "crashed"
    live = await other.stream_started("k", limits)  # keeps the set (and its TTL) alive
    with pytest.raises(RateLimited):
        await other.stream_started("k", limits)
    await asyncio.sleep(0.6)
    again = await other.stream_started("k", limits)  # the crashed slot was reaped
    assert await other._redis.zcard(other.keys("k").streams) == 2
    for slot in (live, again):
        await slot.release()


async def test_keepalive_extends_the_lease(router: Factory) -> None:
    clock = [0.0]
    a = await router(stream_lease_s=30.0, monotonic=lambda: clock[0])
    key = a.keys("k").streams
    slot = await a.stream_started("k", RateLimits(max_streams=1))
    assert isinstance(slot, RedisSlot)
    slot_id = slot.slot_id
    first = await a._redis.zscore(key, slot_id)
    clock[0] = 5.0
    await slot.keepalive()  # within a third of the lease: no Redis call
    assert await a._redis.zscore(key, slot_id) == first
    await a._redis.zrem(key, slot_id)  # as if the lease had run out during a silent stretch
    clock[0] = 11.0
    await slot.keepalive()  # the stream still runs: it gets its slot back, a fresh lease
    renewed = await a._redis.zscore(key, slot_id)
    assert renewed is not None
    assert renewed - await server_time(a) == pytest.approx(30.0, abs=0.5)
    await slot.release()


async def test_redis_down_fails_open_to_local_limits_and_logs_once(
    router: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    assert ratelimit_redis.ON_REDIS_DOWN is OnRedisDown.LOCAL
    caplog.set_level(logging.INFO, LOG)
    down = await router(port=free_port())
    limits = RateLimits(requests_per_min=2, max_streams=1)
    assert [await admitted(down, limits) for _ in range(3)] == [True, True, False]
    slot = await down.stream_started("k", limits)
    with pytest.raises(RateLimited):
        await down.stream_started("k", limits)
    await slot.release()
    await down.charge_tokens("k", RateLimits(tokens_per_min=10), tokens=5, reserved=0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "each router now enforces" in warnings[0].getMessage()
    assert down.down


async def test_redis_down_closed_refuses(router: Factory) -> None:
    down = await router(port=free_port(), on_down=OnRedisDown.CLOSED)
    with pytest.raises(RateLimiterUnavailable) as refused:
        await down.admit("k", RateLimits(requests_per_min=2))
    assert refused.value.retry_after >= 1.0 and "Redis is unreachable" in refused.value.message
    with pytest.raises(RateLimiterUnavailable):
        await down.stream_started("k", RateLimits(max_streams=2))
    assert (await down.admit("k", RateLimits())).headers == {}  # no limits: no Redis needed


async def test_a_hung_redis_costs_one_timeout_then_none(router: Factory) -> None:
    """A FAKE Redis that accepts connections and never answers, like a wedged server."""
    held: list[asyncio.StreamWriter] = []

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        hung = await router(port=port)
        started = time.monotonic()
        assert await admitted(hung, RateLimits(requests_per_min=1))
        assert 0.4 < time.monotonic() - started < 2.0  # REDIS_CALL_TIMEOUT_S, then local
        started = time.monotonic()
        assert not await admitted(hung, RateLimits(requests_per_min=1))
        assert time.monotonic() - started < 0.1  # no new attempt until REDIS_RETRY_S
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


class Relay:
    """A TCP relay to the real Redis that the test can cut and restore, on a fixed port."""

    def __init__(self) -> None:
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()
        await asyncio.gather(*self._pipes)  # each ends once its sockets are closed
        self._writers.clear()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pipes.add(task)
        task.add_done_callback(self._pipes.discard)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", 6379)
        self._writers += [writer, up_writer]

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                dst.close()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(copy(reader, up_writer))
            tg.create_task(copy(up_reader, writer))


async def test_outage_and_recovery_are_logged_once_each(
    router: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOG)
    relay = Relay()
    await relay.start()
    clock = [0.0]
    shared = await router(port=relay.port, monotonic=lambda: clock[0])
    limits = RateLimits(requests_per_min=2)
    assert await admitted(shared, limits) and not shared.down  # Redis counts 1
    await relay.stop()
    assert await admitted(shared, limits) and shared.down  # local counts 1
    assert await admitted(shared, limits)  # local counts 2
    await relay.start()
    assert not await admitted(shared, limits)  # local limit reached; Redis not retried yet
    clock[0] = ratelimit_redis.REDIS_RETRY_S
    adm = await shared.admit("k", limits)  # Redis again, where the count was 1
    assert not shared.down and adm.headers["x-ratelimit-remaining-requests"] == "0"
    await relay.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in m for m in messages) == 1
    assert sum("reachable again" in m for m in messages) == 1
