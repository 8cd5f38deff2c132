"""What becomes of a job whose run failed: run it again, go on from its tokens, wait for a
worker with more context, or fail. Pure: the one rule for a router's workers
(``router/dispatch/running.py``) and a pull-mode worker (``worker/link/redis_pull.py``), so the
same fault gives the same outcome whichever holds the job.

The rule, in the order it is applied:

1. A failure that is the request's own, or the backend's answer to it (``REFUSED``: a 400,
   an error event mid-stream): the client gets it.
2. A prompt longer than the worker's context (``TOO_LONG``) that produced nothing: it waits
   for a worker with more (``need.py`` in the router), for up to ``CONTEXT_REFUSALS`` runs
   beyond ``--max-requeues`` (a refusal is no lost worker, so it does not spend those).
   Each refusal raises what the job needs, ruling out every worker that says it has as
   little context; the bound ends it where a worker says it has more than its llama-server
   holds (``--llama-server-args "-c N"`` overrides ``--ctx-size``), which would otherwise
   take it back again and again: the client then gets llama-server's own 400. (A run going
   on from tokens reports a refusal as ``REFUSED``: the worker could not go on.)
3. Otherwise (the backend was not serving: ``RETRYABLE``; it died mid-answer: ``DIED``; the
   worker was lost: ``LOST``), a job whose answer can go on exactly from the ids the client
   has, with resume attempts left, **goes on**. This holds whether the client has a stream
   (it keeps its stream) or, not streamed, only the worker's progress (what was computed is
   kept; the client gets one whole answer either way). A holder that finds it cannot after
   all (in-process, no worker serves the model any more) asks again with ``resumable``
   false.
4. Otherwise a job whose client has nothing yet (nothing sent, or not streamed: progress
   never reaches the client) **runs again** from the start, while its attempts are within
   ``--max-requeues``.
5. Otherwise it fails (a lost worker's client gets ``worker_lost``).

The two holders used to disagree on two cases, now decided so:

* a non-streamed job with progress, failed retryably (nothing of this run reached the model,
  as when the run that was to go on found its backend restarting): the router ran it again
  from the start, a pull worker went on. It goes on (rule 3): the progress is exact and was
  paid for, and running again would compute it all again;
* a non-streamed job whose backend died mid-answer and that cannot go on (out of resume
  attempts, its ids not exactly known): the router ran it again, a pull worker failed it
  with a 502. It runs again (rule 4): its client has nothing yet, so a second run answers it
  whole, bounded by ``--max-requeues`` as any run again is, and a lost worker's job (rule 3
  then 4) already did so.

A lease that runs out in Redis (the holder vanished without a word) is decided in Lua
(``redis_queue.leases.RECLAIM``): it can only see what was published, so a non-streamed job's
progress counts there as nothing sent, and runs again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shoal.jobs.answer import AnswerSoFar
from shoal.protocol.messages import Endpoint, JobFailed

CONTEXT_REFUSALS = 3
"""Runs a job refused for its context may have beyond ``--max-requeues`` (rule 2): enough to
climb through the context sizes a fleet has, few enough that a worker which says it holds
more than it does ends the job soon."""


class Failure(enum.Enum):
    """How a run failed."""

    REFUSED = "refused"
    """The backend answered with an error (the request's, or one mid-answer): final."""
    TOO_LONG = "too_long"
    """The backend refused the prompt as longer than its context (``context_needed``)."""
    RETRYABLE = "retryable"
    """Nothing of this run reached the model (the backend was restarting, not serving)."""
    DIED = "died"
    """The backend died mid-answer (``resumable``)."""
    LOST = "lost"
    """The worker itself was lost: its connection, heartbeats or the stall rule."""


class Next(enum.Enum):
    """What becomes of the job."""

    RUN_AGAIN = "run again"
    GO_ON = "go on"
    WAIT_FOR_CONTEXT = "wait for context"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Sent:
    """What the failed run had sent, and how far the job's counters got."""

    streamed: bool
    started: bool
    """Output (or, not streamed, progress) was sent on (``AnswerSoFar.started``)."""
    resumable: bool
    """Another run can go on exactly from it (``AnswerSoFar.resumable``)."""
    attempt: int
    """This run's attempt: 1 for the first, more after each run again or resume."""
    resumes: int
    """Times its answer went on elsewhere so far."""

    @classmethod
    def of(
        cls, answer: AnswerSoFar, endpoint: Endpoint, streamed: bool, attempt: int, resumes: int
    ) -> Sent:
        """What a run whose client has ``answer`` sent."""
        return cls(streamed, answer.started, answer.resumable(endpoint), attempt, resumes)


def failure_of(msg: JobFailed) -> Failure:
    """The kind of a worker's ``JobFailed``."""
    if msg.context_needed is not None:
        return Failure.TOO_LONG
    if msg.resumable:
        return Failure.DIED
    if msg.retryable:
        return Failure.RETRYABLE
    return Failure.REFUSED


def after_failure(failure: Failure, sent: Sent, max_requeues: int, resume_attempts: int) -> Next:
    """The rule above: what becomes of a job whose run failed with ``failure``."""
    if failure is Failure.REFUSED:
        return Next.FAIL
    if failure is Failure.TOO_LONG:
        may_wait = not sent.started and sent.attempt <= max_requeues + CONTEXT_REFUSALS
        return Next.WAIT_FOR_CONTEXT if may_wait else Next.FAIL
    if sent.started and sent.resumable and sent.resumes < resume_attempts:
        return Next.GO_ON
    has_nothing = not sent.started or not sent.streamed
    if has_nothing and sent.attempt <= max_requeues:
        return Next.RUN_AGAIN
    return Next.FAIL
