"""What the client has of a running answer, kept by whoever holds the job (a router's
``Running`` for its workers, a pull worker for itself), so that another worker can go on
with it when its own is lost (``protocol.messages.Continuation``).

Pure: fed the chunks as they are sent on (``Chunk.tokens``: the ids whose text each one
completes, None when the client's text is not exactly the text of the ids so far).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from shoal.jobs.events import Trail
from shoal.protocol.messages import Continuation, Endpoint

RESUMABLE = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})
PROGRESS = '{"progress":'
"""How a non-streamed answer's progress that carries log-probabilities begins (the worker's
``WholeAnswer``): ``{"progress": {"logprobs": [...]}, "id": ..., "created": ...}``, one
entry per id of its chunk. No streamed chunk begins so."""


@dataclass(slots=True)
class AnswerSoFar:
    started: bool = False
    """Output was sent on (for a non-streamed job: progress, the client has nothing yet)."""
    tokens: list[int] = field(default_factory=list)
    """The ids of the tokens the client has, from every run."""
    exact: bool = True
    """``tokens`` is exactly what the client has (its last chunk said which ids)."""
    known: bool = True
    """Every id the client has was seen here (not so for a job adopted mid-answer from a
    worker that lost its router)."""
    answer_id: str | None = None
    created: int | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    """A non-streamed answer's log-probabilities of ``tokens``, when it asked for them (its
    progress carries them: ``PROGRESS``)."""

    @classmethod
    def going_on(cls, resume: Continuation) -> AnswerSoFar:
        """The answer of a run that goes on from ``resume``."""
        answer = cls(True, list(resume.tokens), True, True, resume.id, resume.created)
        answer.logprobs = list(resume.logprobs)
        return answer

    @classmethod
    def unknown(cls) -> AnswerSoFar:
        """An answer begun elsewhere, whose ids were not seen here."""
        return cls(started=True, known=False)

    def take(self, data: str, tokens: tuple[int, ...] | None) -> None:
        """One chunk sent on to the client."""
        if not self.started:
            self.started = True
            self.answer_id, self.created = _answer_head(data)
        if tokens is None:
            self.exact = False
        else:
            self.exact = True
            self.tokens += tokens
            if tokens and data.startswith(PROGRESS):
                self.logprobs += orjson.loads(data)["progress"]["logprobs"]

    def resumable(self, endpoint: Endpoint) -> bool:
        """Another run can go on exactly from what the client has."""
        return self.started and self.exact and self.known and endpoint in RESUMABLE

    def continuation(
        self, endpoint: Endpoint, resumes: int, resume_attempts: int
    ) -> Continuation | None:
        """What another worker needs to go on, or None when it may not: nothing sent yet,
        not text, ids not exactly known, or out of resume attempts. (A non-streamed job
        sends its ids as progress the client does not get; it goes on and is answered whole.)"""
        if not self.resumable(endpoint) or resumes >= resume_attempts:
            return None
        return Continuation(
            tokens=tuple(self.tokens),
            id=self.answer_id,
            created=self.created,
            logprobs=tuple(self.logprobs),
        )


def trail_of(tokens: tuple[int, ...] | None, answer: AnswerSoFar) -> Trail:
    """The ``Trail`` event of a chunk just taken into ``answer`` (its head every time: the
    holder's batches keep one trail per job, and a head costs little)."""
    return Trail(tokens or (), tokens is not None, answer.answer_id, answer.created)


def answer_of_trail(ids: str, exact: str, head: str) -> AnswerSoFar:
    """A started answer as its holders' trail in Redis says (``Trail``): the ids as
    ``"1,2,3"``, ``exact`` ``"1"``/``"0"``, the head as JSON; unknown without a trail."""
    if exact not in ("0", "1"):
        return AnswerSoFar.unknown()
    first: dict[str, object] = orjson.loads(head) if head else {}
    answer_id, created = first.get("id"), first.get("created")
    return AnswerSoFar(
        started=True,
        tokens=[int(t) for t in ids.split(",") if t],
        exact=exact == "1",
        answer_id=answer_id if isinstance(answer_id, str) else None,
        created=int(created) if isinstance(created, int | float) else None,
    )


def _answer_head(data: str) -> tuple[str | None, int | None]:
    """The id and creation time of an answer, from its first chunk (read once per job)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(obj, dict):
        return None, None
    answer_id, created = obj.get("id"), obj.get("created")
    return (
        answer_id if isinstance(answer_id, str) else None,
        created if isinstance(created, int) else None,
    )
