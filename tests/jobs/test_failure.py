"""jobs/failure.py: what becomes of a job whose run failed, the one rule of a router's
workers and a pull worker. A table of the cases (the two the holders used to disagree on
among them), then every combination against the rule's properties."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from shoal.jobs.answer import AnswerSoFar
from shoal.jobs.failure import CONTEXT_REFUSALS, Failure, Next, Sent, after_failure, failure_of
from shoal.protocol.ids import JobId
from shoal.protocol.messages import Continuation, Endpoint, ErrorBody, JobFailed

MAX_REQUEUES, RESUME_ATTEMPTS = 2, 2
ERROR = ErrorBody(message="x", type="server_error")

F = Failure
GO_ON, RUN_AGAIN, FAIL, WAIT = Next.GO_ON, Next.RUN_AGAIN, Next.FAIL, Next.WAIT_FOR_CONTEXT


def failed(**flags: Any) -> JobFailed:
    return JobFailed(job_id=JobId("j"), status=502, error=ERROR, **flags)


@pytest.mark.parametrize(
    ("msg", "expected"),
    [
        (failed(), F.REFUSED),
        (failed(retryable=True), F.RETRYABLE),
        (failed(started=True, resumable=True), F.DIED),
        (failed(context_needed=300), F.TOO_LONG),
        (failed(retryable=True, context_needed=300), F.TOO_LONG),
    ],
)
def test_failure_of(msg: JobFailed, expected: Failure) -> None:
    assert failure_of(msg) is expected


def sent(
    streamed: bool = True,
    started: bool = False,
    resumable: bool = False,
    attempt: int = 1,
    resumes: int = 0,
) -> Sent:
    return Sent(streamed, started, resumable, attempt, resumes)


PROGRESS = sent(streamed=False, started=True, resumable=True)
"""A non-streamed job whose worker reported the ids of its answer so far."""


@pytest.mark.parametrize(
    ("failure", "what", "expected"),
    [
        # the request's own error, or the backend's answer: the client gets it
        (F.REFUSED, sent(), FAIL),
        (F.REFUSED, sent(started=True, resumable=True), FAIL),
        # nothing sent yet: run again, within --max-requeues
        (F.RETRYABLE, sent(), RUN_AGAIN),
        (F.LOST, sent(), RUN_AGAIN),
        (F.RETRYABLE, sent(attempt=MAX_REQUEUES + 1), FAIL),
        (F.LOST, sent(attempt=MAX_REQUEUES + 1), FAIL),
        # a stream begun: it goes on, within --resume-attempts; never runs again
        (F.DIED, sent(started=True, resumable=True), GO_ON),
        (F.LOST, sent(started=True, resumable=True), GO_ON),
        (F.RETRYABLE, sent(started=True, resumable=True), GO_ON),  # the run to go on never ran
        (F.DIED, sent(started=True, resumable=True, resumes=RESUME_ATTEMPTS), FAIL),
        (F.LOST, sent(started=True, resumable=False), FAIL),  # its ids not exactly known
        # not streamed: the progress goes on; when it cannot, it runs again (its client has
        # nothing yet), within --max-requeues
        (F.DIED, PROGRESS, GO_ON),
        (F.LOST, PROGRESS, GO_ON),
        # the router ran it again, a pull worker went on: it goes on
        (F.RETRYABLE, PROGRESS, GO_ON),
        # the router ran it again, a pull worker failed it: it runs again
        (F.DIED, sent(streamed=False, started=True, resumes=RESUME_ATTEMPTS), RUN_AGAIN),
        (F.DIED, sent(streamed=False, started=True, resumable=False), RUN_AGAIN),
        (F.DIED, sent(streamed=False, started=True, attempt=MAX_REQUEUES + 1), FAIL),
        # a prompt too long for the worker's context: it waits for one with more, for a few
        # runs beyond --max-requeues (a worker that says it has more than it holds would
        # take it back forever)
        (F.TOO_LONG, sent(), WAIT),
        (F.TOO_LONG, sent(attempt=MAX_REQUEUES + CONTEXT_REFUSALS), WAIT),
        (F.TOO_LONG, sent(attempt=MAX_REQUEUES + CONTEXT_REFUSALS + 1), FAIL),
        (F.TOO_LONG, sent(started=True, resumable=True), FAIL),
    ],
)
def test_after_failure_table(failure: Failure, what: Sent, expected: Next) -> None:
    assert after_failure(failure, what, MAX_REQUEUES, RESUME_ATTEMPTS) is expected


EVERY = list(
    itertools.product(
        Failure,
        [True, False],  # streamed
        [True, False],  # started
        [True, False],  # resumable
        range(1, MAX_REQUEUES + CONTEXT_REFUSALS + 3),  # attempt
        range(RESUME_ATTEMPTS + 2),  # resumes
    )
)


@pytest.mark.parametrize(
    ("failure", "streamed", "started", "resumable", "attempt", "resumes"), EVERY
)
def test_every_combination_keeps_the_rule(
    failure: Failure, streamed: bool, started: bool, resumable: bool, attempt: int, resumes: int
) -> None:
    what = Sent(streamed, started, resumable, attempt, resumes)
    step = after_failure(failure, what, MAX_REQUEUES, RESUME_ATTEMPTS)
    can_go_on = started and resumable and resumes < RESUME_ATTEMPTS
    client_has_nothing = not started or not streamed
    may_run_again = client_has_nothing and attempt <= MAX_REQUEUES
    if failure is F.REFUSED:
        assert step is FAIL
    elif failure is F.TOO_LONG:
        assert step is (FAIL if started or attempt > MAX_REQUEUES + CONTEXT_REFUSALS else WAIT)
    else:
        # what the answer had decides, not how the run failed
        assert all(
            step is after_failure(other, what, MAX_REQUEUES, RESUME_ATTEMPTS)
            for other in (F.RETRYABLE, F.DIED, F.LOST)
        )
        # going on is preferred; running again only where the client has nothing yet; a
        # job fails only when it can do neither
        expected = GO_ON if can_go_on else RUN_AGAIN if may_run_again else FAIL
        assert step is expected
    if step is RUN_AGAIN:
        assert client_has_nothing, "a client with part of a stream never gets it twice"
        assert attempt <= MAX_REQUEUES
    if step is GO_ON:
        assert resumes < RESUME_ATTEMPTS and resumable


def test_sent_reads_what_the_client_has() -> None:
    answer = AnswerSoFar()
    assert Sent.of(answer, Endpoint.CHAT, True, 1, 0) == sent()
    answer.take('{"id":"a","created":1}', (5, 6))
    assert Sent.of(answer, Endpoint.CHAT, False, 2, 1) == sent(False, True, True, 2, 1)
    assert not Sent.of(answer, Endpoint.EMBEDDINGS, True, 1, 0).resumable
    going_on = AnswerSoFar.going_on(Continuation(tokens=(1,)))
    assert Sent.of(going_on, Endpoint.COMPLETIONS, True, 3, 1).started
