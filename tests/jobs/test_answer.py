"""What the client has of an answer, and when another worker may go on with it (pure)."""

from __future__ import annotations

import orjson
import pytest

from shoal.jobs.answer import AnswerSoFar, answer_of_trail
from shoal.protocol.messages import Continuation, Endpoint

HEAD = '{"id":"cmpl-7","created":5,"choices":[]}'


def test_the_ids_and_the_answers_id_are_kept_as_chunks_go_by() -> None:
    answer = AnswerSoFar()
    assert answer.continuation(Endpoint.CHAT, 0, 2) is None  # nothing sent yet
    answer.take(HEAD, ())
    answer.take("x", (1, 2))
    answer.take("y", None)  # the client has text the ids do not spell yet
    assert answer.continuation(Endpoint.CHAT, 0, 2) is None
    answer.take("z", (3,))
    assert answer.continuation(Endpoint.CHAT, 0, 2) == Continuation(
        tokens=(1, 2, 3), id="cmpl-7", created=5
    )


@pytest.mark.parametrize(
    ("endpoint", "resumes", "attempts", "goes_on"),
    [
        (Endpoint.COMPLETIONS, 1, 2, True),
        (Endpoint.CHAT, 0, 2, True),  # streamed or not (a non-streamed job's progress)
        (Endpoint.CHAT, 2, 2, False),  # out of attempts
        (Endpoint.EMBEDDINGS, 0, 2, False),
        (Endpoint.CHAT, 0, 0, False),  # --resume-attempts 0
    ],
)
def test_who_may_go_on(endpoint: Endpoint, resumes: int, attempts: int, goes_on: bool) -> None:
    answer = AnswerSoFar()
    answer.take(HEAD, (4,))
    assert (answer.continuation(endpoint, resumes, attempts) is not None) is goes_on


def test_a_run_that_goes_on_starts_from_what_the_client_has() -> None:
    resume = Continuation(tokens=(1, 2), id="a", created=1)
    answer = AnswerSoFar.going_on(resume)
    answer.take('{"id":"other"}', (3,))  # its chunks already carry the original id
    assert answer.continuation(Endpoint.CHAT, 1, 2) == Continuation(
        tokens=(1, 2, 3), id="a", created=1
    )
    adopted = AnswerSoFar.unknown()
    adopted.take("x", (9,))
    assert adopted.continuation(Endpoint.CHAT, 0, 2) is None


def test_an_answer_read_back_from_its_trail() -> None:
    answer = answer_of_trail("4,5,6", "1", '{"id":"x","created":9}')
    assert answer.continuation(Endpoint.CHAT, 0, 1) == Continuation(
        tokens=(4, 5, 6), id="x", created=9
    )
    inexact = answer_of_trail("4", "0", "")
    assert inexact.continuation(Endpoint.CHAT, 0, 1) is None
    inexact.take("y", (7,))  # the next chunk is exact again: it goes on from every id
    assert inexact.continuation(Endpoint.CHAT, 0, 1) == Continuation(tokens=(4, 7))
    assert not answer_of_trail("", "", "").known  # no trail: nothing known


def test_a_whole_answers_progress_carries_its_log_probabilities_on() -> None:
    """A non-streamed answer that asked for log-probabilities: its progress names them, one
    per id, and they go on with the ids (and again from a run that went on)."""
    answer = AnswerSoFar()
    first = {"token": "a", "logprob": -0.5}
    answer.take(
        '{"progress":{"logprobs":[' + orjson.dumps(first).decode() + ']},"id":"c","created":1}',
        (7,),
    )
    answer.take(
        '{"progress":{"logprobs":[{"token":"b","logprob":-1.0}]},"id":"c","created":1}', (8,)
    )
    resume = answer.continuation(Endpoint.CHAT, 0, 2)
    assert resume is not None and resume.tokens == (7, 8) and resume.id == "c"
    assert resume.logprobs == (first, {"token": "b", "logprob": -1.0})
    again = AnswerSoFar.going_on(resume)
    again.take('{"progress":{"logprobs":[{"token":"c","logprob":0.0}]},"id":"c","created":1}', (9,))
    going = again.continuation(Endpoint.CHAT, 1, 2)
    assert going is not None and [e["token"] for e in going.logprobs] == ["a", "b", "c"]
