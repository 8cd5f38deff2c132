"""Reads the output of many jobs with one blocking ``XREAD``: the router side of streaming.

``RedisJobQueue.events`` holds a Redis connection per job it reads, and wakes per event;
a router streaming hundreds of answers would hold hundreds of connections and spend its
time in per-event round trips. ``OutputTail`` keeps one reader task and one connection:
each ``XREAD BLOCK`` names every watched job's output stream (from the last id seen) plus
this tail's own wake-up stream, and hands what comes back to each job's inbox. Watching
a new job appends to the wake-up stream (once per read, however many jobs arrive), which
ends the current blocking read so the next one includes the new jobs.

Run ``run()`` in the process's task group (nothing is read while it is not running); read
a job with ``async for d in tail.events(job_id)``. Each job's inbox is unbounded: its
reader is expected to keep up (a router forwarding to an HTTP client does). While Redis
is down the reader waits with backoff and resumes every job from its last id, so nothing
is lost or repeated. A watched job whose record vanished (expired) gets ``JobGone``,
checked when a whole blocking read passed without output; an entry that is not an event
gets ``BadEvent``, for its reader only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from shoal.jobs import events
from shoal.jobs.events import Delivered
from shoal.protocol.ids import JobId
from shoal.redis_queue.keys import OUT_TTL_MS, RedisKeys, check_name
from shoal.redis_queue.support import (
    REDIS_DOWN,
    RETRY_FIRST_DELAY_S,
    RETRY_MAX_DELAY_S,
    JobGone,
    OutageLog,
    raise_if_cancelled,
    stream_entries,
)

log = logging.getLogger(__name__)

TAIL_BLOCK_MS = 2_000
TAIL_BATCH = 1_000  # events read per stream per XREAD
WAKE_MAXLEN = 100


@dataclass(eq=False)
class _Watch:
    job_id: JobId
    last_id: str
    inbox: asyncio.Queue[Delivered | Exception] = field(default_factory=asyncio.Queue)


class OutputTail:
    """Output of every job this process streams, through one connection and one reader."""

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        name: str,
        *,
        block_ms: int = TAIL_BLOCK_MS,
        outage: OutageLog | None = None,
    ) -> None:
        self.keys = RedisKeys(prefix)
        self.block_ms = block_ms
        self.outage = outage or OutageLog()
        self._redis = redis
        self._wake_key = self.keys.tail_wake(check_name("tail name", name), secrets.token_hex(4))
        self._wake_id = "0"
        self._watches: dict[str, _Watch] = {}  # output stream key -> watch
        self._reading: frozenset[str] = frozenset()  # streams the current XREAD names
        self._woken = False  # a wake-up was sent that ends the current XREAD

    async def events(self, job_id: JobId, last_id: str = "0") -> AsyncIterator[Delivered]:
        """The job's output from after ``last_id``, ending with its final event."""
        key = self.keys.out(job_id)
        if key in self._watches:
            raise RuntimeError(f"job {job_id} is already being read from this tail")
        watch = _Watch(job_id, last_id)
        self._watches[key] = watch
        try:
            await self._wake(key)
            while True:
                item = await watch.inbox.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if events.is_final(item.event):
                    return
        finally:
            self._watches.pop(key, None)

    async def _wake(self, key: str) -> None:
        if key in self._reading or self._woken:
            return  # the current read includes it, or ends already and the next one will
        self._woken = True
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self._wake_key, {"k": key}, maxlen=WAKE_MAXLEN, approximate=True)
                pipe.pexpire(self._wake_key, OUT_TTL_MS)
                await pipe.execute()
        except REDIS_DOWN as exc:
            # The reader is failing too and includes this job when Redis is back.
            self.outage.failed(f"tail wake-up for {key}", exc)

    async def run(self) -> None:
        """Read until cancelled. Redis outages are waited out with backoff."""
        delay = RETRY_FIRST_DELAY_S
        try:
            while True:
                try:
                    await self._read_once()
                    delay = RETRY_FIRST_DELAY_S
                    self.outage.succeeded()
                except REDIS_DOWN as exc:
                    self.outage.failed("tail", exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_DELAY_S)
        finally:
            with contextlib.suppress(*REDIS_DOWN):  # if not, it expires (OUT_TTL_MS)
                await self._redis.unlink(self._wake_key)

    async def _read_once(self) -> None:
        streams: dict[Any, Any] = {self._wake_key: self._wake_id}
        streams.update((key, w.last_id) for key, w in self._watches.items())
        self._reading = frozenset(streams)
        self._woken = False
        try:
            reply = await self._redis.xread(streams, count=TAIL_BATCH, block=self.block_ms)
        finally:
            self._reading = frozenset()
        raise_if_cancelled()
        entries = list(stream_entries(reply))
        for key, entry_id, fields in entries:
            if key == self._wake_key:
                self._wake_id = entry_id
                continue
            watch = self._watches.get(key)
            if watch is not None:
                watch.last_id = entry_id
                watch.inbox.put_nowait(_delivered(entry_id, fields))
        if not entries and self._watches:  # a whole blocking read without a word
            await self._check_gone()

    async def _check_gone(self) -> None:
        watches = list(self._watches.values())
        async with self._redis.pipeline(transaction=False) as pipe:
            for w in watches:
                pipe.exists(self.keys.job(w.job_id))
            found = await pipe.execute()
        for w, exists in zip(watches, found, strict=True):
            if not exists:
                w.inbox.put_nowait(JobGone(w.job_id))


def _delivered(entry_id: str, fields: dict[str, Any]) -> Delivered | Exception:
    """The event, or the error for its reader alone (one bad entry must not stop the tail)."""
    try:
        return Delivered(entry_id, events.decode(fields["e"]))
    except (KeyError, events.BadEvent) as exc:
        return events.BadEvent(f"entry {entry_id}: {exc}")
