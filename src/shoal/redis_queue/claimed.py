"""A claimed job, and what the consumer holding it does under its lease.

A claim (``RedisJobQueue.claim``, the ``TAKE`` script of ``claim``), a take-over
(``reclaim``) or an adoption hands a consumer a ``Claimed``: the job, the entry of its
queue's stream that is its lease, its attempt, and how far its output and its answer got.
Its holder then takes each step with the job through ``Leases`` (one per consumer), one
script of ``leases`` per step: ``renew`` the leases, ``publish_many`` output
(numbered, so a re-sent event is written once), ``ack`` a job that ended without a final
event, give one back (``requeue``) or put it back to go on elsewhere from what the client
has (``go_on``), and ``adopt`` a running job whose worker now answers through this consumer.
Each step but ``adopt`` is fenced by the lease: once the job was taken over or cancelled,
its old holder's steps are refused (``Lease.LOST`` / ``Lease.CANCELLED``, or False), so a
job never answers twice.

Apart from ``RedisJobQueue`` because it is the other side of a job's life, its holder's:
nothing here blocks, and every step acts on a job this consumer holds (or, ``adopt``,
takes over), where the queue's act on jobs anyone may enqueue, count or cancel (the line
``leases`` draws from ``scripts``). The queue's callers keep one object:
``RedisJobQueue``'s methods of the same names document these steps and pass through to
``Leases``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from redis.typing import EncodableT

from shoal.jobs import events
from shoal.jobs.answer import AnswerSoFar, answer_of_trail
from shoal.jobs.events import Assigned, Failed, Loading, Published, Requeued, Trail
from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import Continuation, Endpoint, ErrorBody
from shoal.redis_queue.calls import QueueCalls
from shoal.redis_queue.support import LEASE_CODES, Lease, QueuedJob, text

log = logging.getLogger(__name__)

_KINDS = {
    events.Data: "d",
    events.Result: "r",
    events.Done: "x",
    events.Failed: "f",
    events.Assigned: "a",
    events.Loading: "a",  # not output: unnumbered, written as it comes
    events.Trail: "t",
}

ENDED_WITHOUT_ANSWER = Failed(
    500,
    ErrorBody(
        message="The job ended without an answer. Retry the request.",
        type="server_error",
        code="no_answer",
    ),
)


class Renews(Protocol):
    """What a ``Claimed`` renews its lease through: its consumer's ``Leases``, or the
    ``RedisJobQueue`` that passes to them."""

    async def renew(self, claims: Sequence[Claimed]) -> dict[JobId, Lease]: ...


@dataclass(eq=False, slots=True)
class Claimed:
    """A job this consumer holds, with the lease on it."""

    job: QueuedJob
    entry_id: str
    attempt: int  # 1 on the first run, more after a take-over or requeue
    queue: Renews = field(repr=False)
    seq: int = 0  # the last event number published (events are numbered for idempotency)
    resume: Continuation | None = None
    """What the client has of the answer: go on from there (its worker was lost)."""
    resumes: int = 0
    """Times the answer went on elsewhere so far."""
    answer: AnswerSoFar | None = None
    """Adopted: what the client has of its answer, from the job's trail."""

    async def renew(self) -> Lease:
        return (await self.queue.renew([self]))[self.job.id]

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq


def encode_resume(resume: Continuation, resumes: int) -> bytes:
    """A job's continuation as its hash keeps it, with the number of resumes so far."""
    return orjson.dumps({"resumes": resumes, "resume": resume.model_dump(mode="json")})


def decode_resume(raw: str) -> tuple[Continuation, int]:
    obj = orjson.loads(raw)
    return Continuation.model_validate(obj["resume"]), int(obj["resumes"])


class Leases:
    """The steps ``consumer`` takes on the jobs it holds, each one lease script
    (``RedisJobQueue`` documents them: its methods of the same names call these)."""

    def __init__(self, calls: QueueCalls, consumer: str) -> None:
        self.calls = calls
        self.consumer = consumer

    def claimed(self, row: Sequence[Any]) -> Claimed:
        """The job a script handed this consumer, from its start fields (``TAKE``,
        ``RECLAIM``, ``ADOPT``)."""
        job_id, _, entry_id, attempt, model, endpoint, stream, body, seq, resume, need = row
        job = QueuedJob(
            id=JobId(text(job_id)),
            model=ModelName(text(model)),
            endpoint=Endpoint(text(endpoint)),
            stream=text(stream) == "1",
            body=orjson.loads(body),
            need=int(text(need) or 0),
        )
        claimed = Claimed(job, text(entry_id), int(attempt), self, seq=int(text(seq)))
        if text(resume):
            claimed.resume, claimed.resumes = decode_resume(text(resume))
        log.info(
            "job %s model=%s claimed by %s (attempt %d)",
            job.id,
            job.model,
            self.consumer,
            claimed.attempt,
        )
        return claimed

    async def renew(self, claims: Sequence[Claimed]) -> dict[JobId, Lease]:
        if not claims:
            return {}
        args: list[EncodableT] = []
        for c in claims:
            args += [c.job.id, c.entry_id]
        codes = await self.calls.run("RENEW", [], args)
        leases = {c.job.id: LEASE_CODES[int(code)] for c, code in zip(claims, codes, strict=True)}
        for job_id, lease in leases.items():
            if lease is not Lease.HELD:
                log.warning("job %s: %s lost its lease (%s)", job_id, self.consumer, lease.name)
        return leases

    async def publish_many(self, items: Sequence[tuple[Claimed, Published]]) -> dict[JobId, Lease]:
        if not items:
            return {}
        args: list[EncodableT] = []
        for claimed, event in items:
            seq = (
                claimed.seq if isinstance(event, Assigned | Loading | Trail) else claimed.next_seq()
            )
            args += [claimed.job.id, seq, _KINDS[type(event)]]
            args.append(events.encode(event))
        codes = await self.calls.run("PUBLISH", [], args)
        leases: dict[JobId, Lease] = {}
        for (claimed, _), code in zip(items, codes, strict=True):
            lease = LEASE_CODES[int(code)]
            if leases.get(claimed.job.id, Lease.HELD) is Lease.HELD:
                leases[claimed.job.id] = lease
        return leases

    async def ack(self, claimed: Claimed) -> bool:
        args: list[EncodableT] = [events.encode(ENDED_WITHOUT_ANSWER)]
        args += [claimed.job.id, claimed.entry_id]
        (code,) = await self.calls.run("ACK", [], args)
        return bool(code == 1)

    async def requeue(self, claimed: Claimed, reason: str, need: int = 0) -> bool:
        args: list[EncodableT] = [claimed.job.id, claimed.entry_id]
        args += [events.encode(Requeued(reason, need or None)), need]
        code = int(await self.calls.run("GIVE_BACK", [], args))
        log.info("job %s requeued by %s: %s (code %d)", claimed.job.id, self.consumer, reason, code)
        return code == 1

    async def go_on(self, claimed: Claimed, reason: str, resume: Continuation) -> bool:
        args: list[EncodableT] = [claimed.job.id, claimed.entry_id]
        args.append(events.encode(Requeued(reason)))
        args.append(encode_resume(resume, claimed.resumes + 1))
        code = int(await self.calls.run("GO_ON", [], args))
        log.info(
            "job %s put back by %s to go on after %d tokens: %s (code %d)",
            claimed.job.id,
            self.consumer,
            len(resume.tokens),
            reason,
            code,
        )
        return code == 1

    async def adopt(self, job_id: JobId, attempt: int) -> Claimed | None:
        row = await self.calls.run("ADOPT", [], [job_id, attempt])
        if row is None:
            return None
        claimed = self.claimed(row[:11])
        claimed.answer = answer_of_trail(*(text(v) for v in row[11:14]))
        return claimed
