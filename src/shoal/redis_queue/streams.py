"""The Redis job queue: a fair queue per (model, endpoint), leases in Redis Streams.

Who does what:

* The **router a client called** ``enqueue``s the job, reads its output with ``events`` (a
  blocking ``XREAD``, resumable from the last entry id) and ``cancel``s it if the client
  goes away.
* A **consumer** (a router serving its WebSocket workers, or a pull-mode worker) ``claim``s
  as many jobs as it has free slots, ``publish``es their output,
  ``renew``s its leases every ``renew_interval_s`` and watches ``cancellations``. A final
  event (``Result``, ``Done``, ``Failed``) ends the job and acknowledges it; ``ack`` is for
  jobs that end without one (cancelled ones).
* **Recovery**: every consumer runs ``reclaim`` now and then for the queues it serves.
  A job whose holder stopped renewing for ``lease_ms`` is taken over: run again if it had
  published no output (at-least-once), or failed with a 502 if it had (the client already
  saw part of an answer). ``sweep`` does the same for every queue without running anything
  (it puts unstarted jobs back), for routers that serve no model themselves.

**Order**: jobs wait in a sorted set per queue, by start tag between API keys (start-time
fair queueing, as ``router/dispatch/fair_queue.py`` does in one router; ``Share`` says whom
a job waits for). Enqueue computes the tag, ``claim`` takes the smallest in one script
(``TAKE``) and blocks, when there is none, on the queue's wake-up stream from the last entry
that script saw (``XREAD``: no polling, no wake-up lost in between). The fairness state (the
virtual time, each key's finish tag, the jobs waiting per key) is in Redis and changes only
inside the scripts, so every router and pull-mode worker on the Redis shares it.

Delivery is at-least-once: a job may run twice (its first holder vanished before it
answered) but never answers twice. Publishes are fenced: once a job was taken over or
cancelled, its old holder's events are refused (``Lease.LOST`` / ``Lease.CANCELLED``).

The ``redis`` client's ``socket_timeout`` must be longer than ``block_ms`` (redis-py's
default of 5 s is, for the default 2 s).

This class is the one object the queue's callers hold; what is not the queue itself lives
beside it. A claimed job and the steps its holder takes under the lease (``renew``,
``publish``, ``ack``, ``requeue``, ``go_on``, ``adopt``): ``claimed``, whose ``Leases``
the methods of those names pass to; take-overs (``reclaim``, ``sweep``): ``recovery``.
Key names: ``keys``. The Lua scripts, called by name through ``calls``:
``scripts`` (the waiting side: ``ENQUEUE``, ``POSITIONS``, ``CANCEL``, ``SETTLE``,
``COUNTS``, ``WAITING``), ``claim`` (``TAKE``, with holds for the consumer whose worker
has a job's prefix) and ``leases`` (the holder's, fenced by the lease). Outages:
``support``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.typing import EncodableT

from shoal.jobs import events
from shoal.jobs.events import Delivered, Published
from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import Continuation, Endpoint
from shoal.redis_queue import scripts
from shoal.redis_queue.calls import QueueCalls
from shoal.redis_queue.claimed import Claimed, Leases
from shoal.redis_queue.keys import (
    CANCEL_SUFFIX,
    CANCELS_TTL_MS,
    JOB_TTL_MS,
    QueueKeys,
    RedisKeys,
    check_name,
)
from shoal.redis_queue.recovery import RECLAIM_BATCH, Recovery
from shoal.redis_queue.support import (
    JobGone,
    JobStatus,
    KeyQueueFull,
    Lease,
    OutageLog,
    QueueCounts,
    QueuedJob,
    QueueFull,
    Share,
    Sweep,
    Waiting,
    raise_if_cancelled,
    stream_entries,
    text,
)

log = logging.getLogger(__name__)

LEASE_MS = 30_000  # a holder silent this long loses its jobs
BLOCK_MS = 2_000  # longest single blocking read (must stay under the socket timeout)
OUTAGE_S = 10.0  # each call rides out a Redis outage this long before raising
EVENTS_BATCH = 512  # output events read per XREAD
BATCH_AGING_MS = 30_000  # router/dispatch/fair_queue.BATCH_AGING_S (a test checks they agree)


class RedisJobQueue:
    """Jobs and their output in Redis, for one consumer (``consumer`` names this process)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        consumer: str,
        *,
        max_len: int = 0,
        lease_ms: int = LEASE_MS,
        block_ms: int = BLOCK_MS,
        outage_s: float = OUTAGE_S,
        outage: OutageLog | None = None,
        resume_attempts: int = 0,
        batch_aging_ms: int = BATCH_AGING_MS,
    ) -> None:
        """``resume_attempts``: a job whose holder stopped renewing mid-answer goes on
        elsewhere this many times (from its trail), else it fails."""
        self.keys = RedisKeys(prefix)
        self.batch_aging_ms = batch_aging_ms
        self.consumer = check_name("consumer name", consumer)
        self.max_len = max_len  # per (model, endpoint), waiting + running; 0: unbounded
        self.lease_ms = lease_ms
        self.block_ms = block_ms
        self.outage_s = outage_s
        self.outage = outage or OutageLog()  # logs an outage once, however many calls see it
        self._redis = redis
        self._check_block(block_ms)
        self.calls = QueueCalls(
            redis, self.keys, self.consumer, outage_s=outage_s, outage=self.outage
        )
        self._leases = Leases(self.calls, self.consumer)
        self._recovery = Recovery(self.calls, self.keys, self.consumer, lease_ms, resume_attempts)
        self._counts = redis.register_script(scripts.COUNTS)
        self._waiting = redis.register_script(scripts.WAITING)
        self._settle = redis.register_script(scripts.SETTLE)

    @property
    def renew_interval_s(self) -> float:
        """How often a holder should ``renew``: three chances before the lease runs out."""
        return self.lease_ms / 3000

    def _check_block(self, block_ms: int) -> None:
        if block_ms <= 0:
            raise ValueError(f"block_ms must be positive (got {block_ms}): 0 blocks forever")
        timeout = self._redis.connection_pool.connection_kwargs.get("socket_timeout")
        if timeout is not None and block_ms >= timeout * 1000:
            raise ValueError(
                f"blocking reads of {block_ms} ms would outlast the Redis client's "
                f"socket_timeout of {timeout} s: lower block_ms or raise socket_timeout"
            )

    # ------------------------------------------------------------ client side

    async def enqueue(
        self, job: QueuedJob, share: Share | None = None, hold: tuple[str, int] | None = None
    ) -> bool:
        """Queue ``job`` for ``share``'s key; False if a job with its id is already queued
        (nothing changes). ``hold``: (consumer, ms) only that consumer may claim it for
        those ms (``claim``).

        Raises ``QueueFull`` when its queue already holds ``max_len`` waiting or running
        jobs, ``KeyQueueFull`` when the key has ``share.max_queued`` jobs waiting (anywhere).
        """
        check_name("job id", job.id)
        share = share or Share()
        q = self.keys.queue_keys(job.model, job.endpoint)
        keys = [self.keys.job(job.id), q.stream, self.keys.queues, q.ready, q.batch, q.aging]
        keys += [q.fair, q.wake, self.keys.key_waiting]
        args: list[EncodableT] = [self.max_len, JOB_TTL_MS, job.model, job.endpoint.value]
        args += ["1" if job.stream else "0", orjson.dumps(dict(job.body)), job.id]
        args += [share.tenant, repr(float(share.weight)), "batch" if share.batch else "interactive"]
        args += [repr(float(share.work)), "fair" if share.fair else "fifo"]
        args += [-1 if share.max_queued is None else share.max_queued, *(hold or ("", 0))]
        args.append(job.need)
        code, depth = await self.calls.run("ENQUEUE", keys, args)
        if code == -1:
            raise QueueFull(job.model, job.endpoint, int(depth), self.max_len)
        if code == -2:
            raise KeyQueueFull(share.tenant, int(depth), share.max_queued or 0)
        log.debug("job %s model=%s queued (depth %s, new=%s)", job.id, job.model, depth, code)
        return bool(code == 1)

    async def events(
        self, job_id: JobId, last_id: str = "0", *, block_ms: int | None = None
    ) -> AsyncIterator[Delivered]:
        """The job's output from after ``last_id``, ending with its final event.

        Resume after a break by passing the last ``Delivered.id`` seen. Raises ``JobGone``
        if the job's record disappears (it expired) while nothing more arrives. A cancelled
        job has no final event: its canceller stops reading.
        """
        block = self.block_ms if block_ms is None else block_ms
        self._check_block(block)
        key = self.keys.out(job_id)
        while True:
            reply = await self._read(key, last_id, block)
            raise_if_cancelled()
            got = False
            for _, entry_id, fields in stream_entries(reply):
                got = True
                last_id = entry_id
                event = events.decode(fields["e"])
                yield Delivered(entry_id, event)
                if events.is_final(event):
                    return
            if not got and not await self.calls.retry(
                lambda: self._redis.exists(self.keys.job(job_id)), "events"
            ):
                raise JobGone(job_id)

    async def _read(self, key: str, last_id: str, block: int) -> Any:
        return await self.calls.retry(
            lambda: self._redis.xread({key: last_id}, count=EVENTS_BATCH, block=block), key
        )

    async def cancel(self, job_id: JobId) -> JobStatus:
        """Cancel wherever the job is; returns the state it was found in.

        WAITING: removed from its queue. RUNNING: its holder is told (``cancellations``)
        and its further output is refused. Anything else: nothing to do.
        """
        return await self._cancel(job_id, only_waiting=False)

    async def withdraw(self, job_id: JobId) -> bool:
        """Remove the job only if no consumer took it yet (a wait limit ran out)."""
        return await self._cancel(job_id, only_waiting=True) is JobStatus.WAITING

    async def _cancel(self, job_id: JobId, *, only_waiting: bool) -> JobStatus:
        args: list[EncodableT] = [job_id, "1" if only_waiting else "0"]
        args.append(self.keys.consumer_key_prefix)
        args += [CANCEL_SUFFIX, CANCELS_TTL_MS]
        found = JobStatus(text(await self.calls.run("CANCEL", [], args)))
        log.info("job %s cancelled (was %s, only_waiting=%s)", job_id, found, only_waiting)
        return found

    async def status(self, job_id: JobId) -> JobStatus:
        state = await self.calls.retry(
            lambda: self._redis.hget(self.keys.job(job_id), "state"), "status"
        )
        return JobStatus.MISSING if state is None else JobStatus(text(state))

    async def depth(self, model: ModelName, endpoint: Endpoint) -> int:
        """Jobs waiting or running for (model, endpoint): what ``max_len`` bounds."""
        counts = await self.counts(model, endpoint)
        return counts.waiting + counts.running

    async def counts(self, model: ModelName, endpoint: Endpoint) -> QueueCounts:
        q = self.keys.queue_keys(model, endpoint)
        keys = [q.stream, q.ready, q.batch]
        waiting, running = await self.calls.retry(lambda: self._counts(keys=keys), "counts")
        return QueueCounts(waiting=int(waiting), running=int(running))

    async def waiting(self) -> dict[tuple[ModelName, Endpoint], int]:
        """Jobs waiting (not yet claimed) in every queue under the prefix, in one call
        (queues listed by the ``queues`` set, never ``SCAN``)."""
        return {key: w.count for key, w in (await self.waiting_ages()).items()}

    async def waiting_ages(self) -> dict[tuple[ModelName, Endpoint], Waiting]:
        """Per queue, the jobs waiting and how long the oldest of them has waited (since it
        last started to wait, by Redis's clock), in one call."""
        keys = [self.keys.queues]
        args = [*self.keys.queue_kind_prefixes()[:3], self.keys.job(JobId(""))]
        flat = await self.calls.retry(lambda: self._waiting(keys=keys, args=args), "waiting")
        now = int(flat[0])
        found: dict[tuple[ModelName, Endpoint], Waiting] = {}
        for queue, n, since in zip(flat[1::3], flat[2::3], flat[3::3], strict=True):
            if (key := self.keys.parse_queue(text(queue))) is not None:
                age = (now - int(since)) / 1000 if int(since) >= 0 else 0.0
                found[key] = Waiting(int(n), max(age, 0.0))
        return found

    async def waiting_by_key(self) -> dict[str, int]:
        """Jobs waiting per API key over every queue (what ``Share.max_queued`` bounds)."""
        raw = await self.calls.retry(
            lambda: self._redis.hgetall(self.keys.key_waiting), "waiting by key"
        )
        return {text(k): int(v) for k, v in raw.items() if int(v) > 0}

    async def positions(self, job_ids: Sequence[JobId]) -> dict[JobId, int]:
        """How many jobs go before each of these waiting jobs, in one script call; a job
        that no longer waits is left out."""
        if not job_ids:
            return {}
        args: list[EncodableT] = [self.batch_aging_ms, *job_ids]
        places = await self.calls.run("POSITIONS", [], args)
        return {job_id: int(p) for job_id, p in zip(job_ids, places, strict=True) if int(p) >= 0}

    async def settle(
        self, model: ModelName, endpoint: Endpoint, share: Share, actual: float
    ) -> None:
        """A job of ``share`` ended having done ``actual`` work where ``share.work`` was
        charged: its key's next jobs in that queue start that much later (or earlier)."""
        keys = [self.keys.queue_keys(model, endpoint).fair]
        args: list[EncodableT] = [share.tenant, repr(float(share.weight))]
        args += [repr(float(share.work)), repr(float(actual))]
        await self.calls.retry(lambda: self._settle(keys=keys, args=args), "settle")

    # ------------------------------------------------------------ consumer side

    async def claim(
        self,
        keys: Sequence[tuple[ModelName, Endpoint]],
        count: int,
        block_ms: int | None = None,
        limits: Mapping[tuple[ModelName, Endpoint], int] | None = None,
    ) -> list[Claimed]:
        """Take up to ``count`` waiting jobs from these queues: in each, by start tag
        (interactive and aged batch work first); across queues, the head that waited
        longest. ``limits``: per queue, the most tokens of context a job taken may need (the
        claimer's largest slot; 0 or none: any), so a job whose prompt no slot of the
        claimer's holds waits for one that does.

        Waits up to ``block_ms`` (0: not at all) for one to arrive; an empty list means none
        came. A claim cancelled while its script runs may leave jobs taken for this consumer
        but not handed over: they run elsewhere after the lease (``reclaim``).
        """
        raise_if_cancelled()
        if count <= 0 or not keys:
            return []
        pairs = list(dict.fromkeys(keys))
        queues = [self.keys.queue_keys(m, e) for m, e in pairs]
        most = [(limits or {}).get(pair, 0) for pair in pairs]
        block = self.block_ms if block_ms is None else block_ms
        deadline = time.monotonic() + block / 1000
        while True:
            taken, cursors, held_ms = await self._take(queues, count, most)
            left_ms = int((deadline - time.monotonic()) * 1000)
            if held_ms > 0:  # a job held for another consumer is ours once its hold ends
                left_ms = min(left_ms, held_ms)
            if taken or left_ms <= 0 or not await self._wait_wake(queues, cursors, left_ms):
                break
        raise_if_cancelled()  # jobs taken here are recovered after the lease, as documented
        return [self._leases.claimed(row) for row in taken]

    async def _take(
        self, queues: Sequence[QueueKeys], count: int, limits: Sequence[int] = ()
    ) -> tuple[list[Any], list[str], int]:
        keys = [self.keys.key_waiting] + [k for q in queues for k in q.all()]
        args: list[EncodableT] = [count, self.batch_aging_ms, *limits]
        taken, cursors, held_ms = await self.calls.run("TAKE", keys, args)
        return list(taken), [text(c) for c in cursors], int(held_ms)

    async def _wait_wake(self, queues: Sequence[QueueKeys], cursors: list[str], ms: int) -> bool:
        """Block until a job starts to wait in one of ``queues`` after ``cursors`` (the
        wake-up ids the last ``TAKE`` saw), or ``ms`` pass; False if none did."""
        self._check_block(ms)
        streams: dict[Any, Any] = {q.wake: c for q, c in zip(queues, cursors, strict=True)}
        reply = await self.calls.retry(
            lambda: self._redis.xread(streams, count=1, block=ms), "claim"
        )
        return bool(reply)

    # the holder's steps under the lease: ``Leases`` (``claimed``) takes them

    async def renew(self, claims: Sequence[Claimed]) -> dict[JobId, Lease]:
        """Extend the leases on jobs this consumer holds, in one round trip."""
        return await self._leases.renew(claims)

    async def publish(self, claimed: Claimed, event: Published) -> Lease:
        """Append one event; LOST or CANCELLED means stop working on the job."""
        return (await self.publish_many([(claimed, event)]))[claimed.job.id]

    async def publish_many(self, items: Sequence[tuple[Claimed, Published]]) -> dict[JobId, Lease]:
        """Append events of any jobs this consumer holds, in one round trip.

        Output events are numbered (``Claimed.seq``: a re-sent one is written once); an
        ``Assigned`` naming the worker that runs the job is not (a re-sent one is written
        again: readers take the last). Returns, per job, HELD if all its events were
        written, else why not. Call it again only with new events: a call that raised may
        have been written (it already rode out ``outage_s`` of outage, resending the same
        events).
        """
        return await self._leases.publish_many(items)

    async def ack(self, claimed: Claimed) -> bool:
        """Done with the job. A job still running gets a 500 ``Failed`` (it had no answer).

        False if this consumer no longer held it (someone else acks it).
        """
        return await self._leases.ack(claimed)

    async def requeue(self, claimed: Claimed, reason: str, need: int = 0) -> bool:
        """Give a held job back to its queue (first in its class) for another consumer to run;
        ``need``: the tokens of context it needs from now on, when more than before (its
        prompt was refused as too long: only a claimer with that much takes it).

        False if it had already published output (publish ``Failed`` instead) or is no
        longer this consumer's.
        """
        return await self._leases.requeue(claimed, reason, need)

    async def go_on(self, claimed: Claimed, reason: str, resume: Continuation) -> bool:
        """Give back a held job that answered in part, to go on from ``resume`` on the next
        holder (first in its class). False if it is no longer this consumer's."""
        return await self._leases.go_on(claimed, reason, resume)

    async def adopt(self, job_id: JobId, attempt: int) -> Claimed | None:
        """Take over a running job whose worker now answers through this consumer.

        For a push-mode worker that lost its router and reconnected here mid-answer: its
        output so far stays and it goes on publishing (from ``Claimed.seq``, the number of
        events published so far); the previous holder is fenced off. None if the job is no
        longer running, or is running as another ``attempt`` (it was run again elsewhere).
        """
        return await self._leases.adopt(job_id, attempt)

    async def cancellations(self, *, block_ms: int | None = None) -> AsyncIterator[JobId]:
        """Ids of jobs this consumer holds that were cancelled, as they come (``BLPOP``)."""
        block = self.block_ms if block_ms is None else block_ms
        self._check_block(block)
        key = self.keys.cancels(self.consumer)
        while True:
            popped = await self.calls.retry(
                lambda: self._redis.blpop([key], timeout=block / 1000), "cancellations"
            )
            raise_if_cancelled()
            if popped:
                yield JobId(text(popped[1]))

    # ------------------------------------------------------------ recovery

    async def reclaim(
        self,
        keys: Sequence[tuple[ModelName, Endpoint]],
        min_idle_ms: int | None = None,
        *,
        count: int = RECLAIM_BATCH,
    ) -> list[Claimed]:
        """Take over up to ``count`` (free slots) jobs of these queues whose holder has not
        renewed for ``min_idle_ms`` (default: the lease).

        Jobs that had published output get a 502 ``Failed`` and are dropped; the rest are
        returned to be run again.
        """
        queues = [self.keys.queue(model, endpoint) for model, endpoint in dict.fromkeys(keys)]
        rows = await self._recovery.take_over(queues, count, min_idle_ms)
        return [self._leases.claimed(row) for row in rows]

    async def sweep(self, min_idle_ms: int | None = None) -> Sweep:
        """Recover every queue under the prefix without running anything.

        Jobs whose holder vanished go back to their queue (or fail if they had answered),
        and consumers gone for an hour are removed from the group. Nothing is done within a
        lease of a Redis outage (``OutageLog.within``): holders get to renew first.
        """
        return await self._recovery.sweep(min_idle_ms)
