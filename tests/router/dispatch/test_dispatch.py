"""The dispatcher on its own: real registry and worker connections, no sockets."""

from __future__ import annotations

import pytest

from shoal.jobs.events import ClientEvent, Failed, Requeued
from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import (
    Continuation,
    Endpoint,
    ErrorBody,
    JobCancel,
    JobDone,
    JobFailed,
    JobStart,
    ModelInfo,
    RunningJob,
    decode_router_message,
)
from shoal.router.dispatch.fair_queue import Tenant
from shoal.router.dispatch.interface import Dispatcher
from shoal.router.dispatch.job import Job, JobState, Submission
from shoal.router.dispatch.workers import WorkerConnection
from shoal.router.errors import BadRequest, QueueFull
from shoal.router.settings import RouterSettings
from socketless import memory_dispatcher, worker_connection

M = ModelName("smol")


def connect(dispatcher: Dispatcher, name: str, endpoints: tuple[Endpoint, ...]) -> WorkerConnection:
    worker = worker_connection(name, [ModelInfo(name=M, endpoints=endpoints)])
    dispatcher.workers.on_registered(worker)
    return worker


def started(worker: WorkerConnection) -> list[str]:
    out = []
    while not worker.outbox.empty():
        msg = decode_router_message(worker.outbox.get_nowait())
        if isinstance(msg, JobStart):
            out.append(msg.job_id)
    return out


def test_a_waiting_embeddings_job_does_not_hold_up_chat() -> None:
    dispatcher = memory_dispatcher()
    chat = connect(dispatcher, "chat", (Endpoint.CHAT, Endpoint.COMPLETIONS))
    embed = connect(dispatcher, "embed", (Endpoint.EMBEDDINGS,))
    first = dispatcher.submit(Submission(M, Endpoint.EMBEDDINGS, False, {"input": "a"}))
    waiting = dispatcher.submit(Submission(M, Endpoint.EMBEDDINGS, False, {"input": "b"}))
    answer = dispatcher.submit(Submission(M, Endpoint.CHAT, True, {"messages": []}))
    assert first.state is JobState.ASSIGNED and first.worker_id == "embed"
    assert waiting.state is JobState.QUEUED
    assert answer.state is JobState.ASSIGNED and answer.worker_id == "chat"
    assert started(embed) == [first.id] and started(chat) == [answer.id]
    assert dispatcher.queue_depths().get(M, 0) == 1


def test_lost_worker_requeues_unstarted_jobs_at_the_head() -> None:
    dispatcher = memory_dispatcher()
    doomed = connect(dispatcher, "doomed", (Endpoint.CHAT,))
    held = dispatcher.submit(Submission(M, Endpoint.CHAT, True, {"messages": []}))
    later = dispatcher.submit(Submission(M, Endpoint.CHAT, True, {"messages": []}))
    dispatcher.workers.on_lost(doomed, "test")
    assert held.state is JobState.QUEUED and held.requeues == 1
    rescuer = connect(dispatcher, "rescuer", (Endpoint.CHAT,))
    assert started(rescuer) == [held.id]  # the re-queued job goes first
    assert later.state is JobState.QUEUED


def test_jobs_a_worker_still_runs_from_a_lost_connection_are_cancelled() -> None:
    """The in-process queue ended them when the connection dropped: nothing to resume."""
    dispatcher = memory_dispatcher()
    worker = worker_connection("w", [ModelInfo(name=M, endpoints=(Endpoint.CHAT,))])
    dispatcher.workers.on_registered(worker, (RunningJob(job_id=JobId("j1"), attempt=1),))
    assert decode_router_message(worker.outbox.get_nowait()) == JobCancel(job_id=JobId("j1"))


def test_a_key_past_its_queue_cap_gets_429_and_other_keys_do_not() -> None:
    """``max_queued`` counts the key's jobs waiting on this router, every model and endpoint
    together; a job that finds a free slot does not wait, so it is never refused."""
    dispatcher = memory_dispatcher()
    connect(dispatcher, "w", (Endpoint.CHAT, Endpoint.COMPLETIONS))  # one slot
    capped, other = Tenant("a", max_queued=2), Tenant("b")

    def ask(tenant: Tenant, endpoint: Endpoint = Endpoint.CHAT) -> Submission:
        return Submission(M, endpoint, False, {"messages": []}, tenant)

    running = dispatcher.submit(ask(capped))  # the free slot: no waiting, no cap
    waiting = [dispatcher.submit(ask(capped)), dispatcher.submit(ask(capped, Endpoint.COMPLETIONS))]
    assert running.state is JobState.ASSIGNED
    assert [j.state for j in waiting] == [JobState.QUEUED, JobState.QUEUED]
    with pytest.raises(QueueFull) as refused:
        dispatcher.submit(ask(capped))
    assert refused.value.code == "key_queue_full" and refused.value.headers["Retry-After"] == "2"
    assert "This API key's queue is full: at most 2 of its requests" in refused.value.message
    assert dispatcher.submit(ask(other)).state is JobState.QUEUED  # other keys: unaffected
    assert dispatcher.queue_depths()[M] == 3

    dispatcher.cancel(waiting[0], "client left")  # one of its requests stops waiting
    assert dispatcher.submit(ask(capped)).state is JobState.QUEUED


def test_a_key_that_may_not_wait_runs_only_on_a_free_slot() -> None:
    dispatcher = memory_dispatcher()
    connect(dispatcher, "w", (Endpoint.CHAT,))
    never = Tenant("a", max_queued=0)
    ask = Submission(M, Endpoint.CHAT, False, {"messages": []}, never)
    first = dispatcher.submit(ask)
    assert first.state is JobState.ASSIGNED
    with pytest.raises(QueueFull, match="its requests may not wait for a worker"):
        dispatcher.submit(ask)
    assert not dispatcher.queue_depths().get(M)


def _starts(worker: WorkerConnection) -> list[JobStart]:
    out = []
    while not worker.outbox.empty():
        msg = decode_router_message(worker.outbox.get_nowait())
        if isinstance(msg, JobStart):
            out.append(msg)
    return out


def _events(job: Job) -> list[ClientEvent]:
    out = []
    while not job.events.empty():
        out.append(job.events.get_nowait())
    return out


HEAD = '{"id":"chatcmpl-1","created":7,"choices":[{"delta":{"role":"assistant"}}]}'


def test_an_answer_whose_worker_is_lost_goes_on_elsewhere_from_its_tokens() -> None:
    dispatcher = memory_dispatcher(RouterSettings(resume_attempts=1))
    first = connect(dispatcher, "first", (Endpoint.CHAT,))
    job = dispatcher.submit(Submission(M, Endpoint.CHAT, True, {"messages": []}))
    [start] = _starts(first)
    assert start.resume is None
    dispatcher.workers.on_chunks(first, [(job.id, HEAD, ()), (job.id, "a", (1, 2))])
    second = connect(dispatcher, "second", (Endpoint.CHAT,))
    dispatcher.workers.on_lost(first, "test")
    assert job.state is JobState.ASSIGNED and job.worker_id == "second"
    [again] = _starts(second)
    assert again.resume == Continuation(tokens=(1, 2), id="chatcmpl-1", created=7)
    assert again.attempt == 2
    dispatcher.workers.on_chunks(first, [(job.id, "late", (3,))])  # fenced: not its job now
    dispatcher.workers.on_chunks(second, [(job.id, "b", (3,))])
    assert [type(e).__name__ for e in _events(job)] == ["Data", "Data", "Requeued", "Data"]
    assert job.state is JobState.STREAMING
    # Out of resume attempts: the next loss ends the stream with the 502 of a lost worker.
    dispatcher.workers.on_lost(second, "test")
    [failed] = _events(job)
    assert isinstance(failed, Failed) and failed.error.code == "worker_lost"


def test_an_answer_whose_tokens_are_not_known_fails_as_before() -> None:
    dispatcher = memory_dispatcher()
    first = connect(dispatcher, "first", (Endpoint.CHAT,))
    connect(dispatcher, "second", (Endpoint.CHAT,))
    job = dispatcher.submit(Submission(M, Endpoint.CHAT, True, {"messages": []}))
    owner = first if job.worker_id == "first" else dispatcher.registry.get(job.worker_id or "")
    assert owner is not None
    dispatcher.workers.on_chunks(owner, [(job.id, HEAD, ()), (job.id, "a", None)])
    dispatcher.workers.on_lost(owner, "test")
    assert isinstance(_events(job)[-1], Failed)


def test_a_dead_backend_mid_answer_goes_on_elsewhere_but_not_when_nobody_serves_it() -> None:
    dispatcher = memory_dispatcher()
    only = connect(dispatcher, "only", (Endpoint.COMPLETIONS,))
    job = dispatcher.submit(Submission(M, Endpoint.COMPLETIONS, True, {"prompt": "x"}))
    dispatcher.workers.on_chunks(only, [(job.id, HEAD, (4,))])
    _starts(only)
    error = ErrorBody(message="backend died", type="server_error", code="backend_error")
    dead = JobFailed(job_id=job.id, status=502, error=error, started=True, resumable=True)
    dispatcher.workers.on_message(only, dead)
    [again] = _starts(only)  # its llama-server restarts; the same worker may go on
    assert again.resume is not None and again.resume.tokens == (4,)
    dispatcher.workers.on_lost(only, "test")  # and now nobody serves the model
    assert isinstance(_events(job)[-1], Failed)


def _frames(worker: WorkerConnection) -> list[object]:
    out = []
    while not worker.outbox.empty():
        out.append(decode_router_message(worker.outbox.get_nowait()))
    return out


HEAVY, LIGHT = Tenant("heavy"), Tenant("light")
TEN = tuple(range(10))  # ids of ten tokens: past ``preemption.MIN_TOKENS``


@pytest.mark.parametrize("preempt", [True, False])
def test_a_light_key_pauses_a_heavy_answer_which_goes_on_from_its_tokens(preempt: bool) -> None:
    dispatcher = memory_dispatcher(RouterSettings(preempt=preempt))
    worker = worker_connection("w", [ModelInfo(name=M, endpoints=(Endpoint.CHAT,))], slots=2)
    dispatcher.workers.on_registered(worker)
    body: dict[str, object] = {"messages": []}
    heavy = [dispatcher.submit(Submission(M, Endpoint.CHAT, True, body, HEAVY)) for _ in range(3)]
    dispatcher.workers.on_chunks(worker, [(heavy[0].id, HEAD, ()), (heavy[0].id, "a", TEN)])
    # the other running answer has more tokens: the one with fewer is paused
    dispatcher.workers.on_chunks(worker, [(heavy[1].id, HEAD, ()), (heavy[1].id, "a", TEN * 2)])
    _frames(worker)
    light = dispatcher.submit(Submission(M, Endpoint.CHAT, True, body, LIGHT))
    if not preempt:
        assert light.state is JobState.QUEUED and not _frames(worker)
        return
    cancel, start = _frames(worker)
    assert cancel == JobCancel(job_id=heavy[0].id)
    assert isinstance(start, JobStart) and start.job_id == light.id
    assert light.state is JobState.ASSIGNED
    assert heavy[0].state is JobState.QUEUED and heavy[0].preemptions == 1
    assert heavy[0].resumes == 0  # a pause uses up no --resume-attempts
    # a frame of the cancelled run still on its way is dropped
    dispatcher.workers.on_chunks(worker, [(heavy[0].id, "late", (99,))])
    assert [type(e).__name__ for e in _events(heavy[0])] == ["Data", "Data", "Requeued"]
    # the light answer runs past MIN_TOKENS: it took its slot by a pause, nobody pauses it
    dispatcher.workers.on_chunks(worker, [(light.id, HEAD, ()), (light.id, "x", TEN)])
    assert light.state is JobState.STREAMING and not _frames(worker)
    # its slot frees: the paused answer goes on first, under a new run id, from its tokens
    dispatcher.workers.on_message(worker, JobDone(job_id=light.id))
    [again] = _starts(worker)
    assert again.job_id == f"{heavy[0].id}.1" and again.resume is not None
    assert again.resume.tokens == TEN and again.resume.id == "chatcmpl-1"
    assert heavy[2].state is JobState.QUEUED
    dispatcher.workers.on_chunks(worker, [(heavy[0].id, "late", (99,))])  # old run: dropped
    dispatcher.workers.on_chunks(worker, [(again.job_id, "b", (10,))])
    assert [type(e).__name__ for e in _events(heavy[0])] == ["Data"]
    # paused once already: never again
    other = dispatcher.submit(Submission(M, Endpoint.CHAT, True, body, Tenant("other")))
    dispatcher.workers.on_chunks(worker, [(again.job_id, "c", TEN)])
    cancel, start = _frames(worker)
    assert cancel == JobCancel(job_id=heavy[1].id)
    assert isinstance(start, JobStart) and start.job_id == other.id
    dispatcher.cancel(heavy[0], "client left")  # its run id is the one cancelled
    assert _frames(worker)[0] == JobCancel(job_id=again.job_id)


# ---------------------------------------------------------------- context per slot


def sized(dispatcher: Dispatcher, name: str, context: int | None) -> WorkerConnection:
    """A one-slot worker serving ``M`` with ``context`` tokens per slot (None: unsaid)."""
    info = ModelInfo(name=M, endpoints=(Endpoint.CHAT,), context_length=context)
    worker = worker_connection(name, [info])
    dispatcher.workers.on_registered(worker)
    return worker


def ask(text: str, **extra: object) -> Submission:
    return Submission(
        M, Endpoint.CHAT, False, {"messages": [{"role": "user", "content": text}], **extra}
    )


LONG = "word " * 2800  # 14,000 bytes: about 3,500 tokens by the estimate, at least 110


def test_a_long_prompt_goes_only_to_a_worker_whose_context_holds_it() -> None:
    dispatcher = memory_dispatcher()
    small, big = sized(dispatcher, "small", 2048), sized(dispatcher, "big", 4096)
    first, second = dispatcher.submit(ask(LONG)), dispatcher.submit(ask(LONG))
    assert first.worker_id == "big" and first.need == 3502  # (14,004 bytes) / 4, and one
    assert second.state is JobState.QUEUED  # the small worker is free, but too small
    short = dispatcher.submit(ask("hi"))
    assert short.worker_id == "small"  # a short one takes the small worker meanwhile
    assert started(small) == [short.id] and started(big) == [first.id]


def test_a_prompt_refused_as_too_long_goes_to_a_worker_with_more_context() -> None:
    """The estimate was optimistic (a 1-byte-a-token prompt): llama-server refuses it; the
    job waits for a worker with the context llama-server counted, and gets it."""
    dispatcher = memory_dispatcher(RouterSettings(max_requeues=0))
    small, big = sized(dispatcher, "small", 2048), sized(dispatcher, "big", 4096)
    busy = dispatcher.submit(ask(LONG))  # takes the big worker
    digits = dispatcher.submit(ask("7391" * 800))  # 3,200 bytes: about 800 tokens
    assert busy.worker_id == "big" and digits.worker_id == "small"
    started(small)
    error = ErrorBody(message="request (3215 tokens) exceeds", type="exceed_context_size_error")
    refusal = JobFailed(job_id=digits.id, status=400, error=error, context_needed=3216)
    dispatcher.workers.on_message(small, refusal)
    assert digits.state is JobState.QUEUED and digits.need == 3216
    assert [type(e) for e in _events(digits)] == [Requeued]  # not the client's 400
    dispatcher.workers.on_message(big, JobDone(job_id=busy.id))
    assert digits.worker_id == "big" and started(big)[-1] == digits.id


def test_a_prompt_refused_by_the_largest_context_gets_the_routers_400() -> None:
    dispatcher = memory_dispatcher()
    big = sized(dispatcher, "big", 4096)
    job = dispatcher.submit(ask("7391" * 1500))  # about 1,500 tokens by the estimate
    error = ErrorBody(message="request (6015 tokens) exceeds", type="exceed_context_size_error")
    dispatcher.workers.on_message(
        big, JobFailed(job_id=job.id, status=400, error=error, context_needed=6016)
    )
    [failed] = _events(job)
    assert isinstance(failed, Failed) and failed.status == 400
    assert failed.error.code == "context_length_exceeded"
    assert "the largest holds 4096 tokens" in failed.error.message
    assert "needs at least 6016" in failed.error.message and "max_tokens" in failed.error.message


@pytest.mark.parametrize(
    ("submission", "param", "detail"),
    [
        (ask("hi", max_tokens=5000), "max_tokens", "it asks for 5000 tokens of answer"),
        (ask("hi", max_completion_tokens=4096), "max_completion_tokens", "4096 tokens"),
        (ask("x" * 600_000), "messages", "its prompt is at least 4688 tokens"),
    ],
)
def test_a_request_no_worker_could_hold_is_refused_at_once(
    submission: Submission, param: str, detail: str
) -> None:
    dispatcher = memory_dispatcher()
    sized(dispatcher, "small", 2048)
    sized(dispatcher, "big", 4096)
    with pytest.raises(BadRequest) as refused:
        dispatcher.submit(submission)
    assert refused.value.param == param and refused.value.code == "context_length_exceeded"
    assert "the largest holds 4096 tokens" in refused.value.message
    assert detail in refused.value.message
    assert not dispatcher.queue_depths().get(M)  # nothing waits


def test_a_worker_that_does_not_say_its_context_takes_any_request() -> None:
    dispatcher = memory_dispatcher()
    sized(dispatcher, "small", 2048)
    sized(dispatcher, "attached", None)
    job = dispatcher.submit(ask("x" * 600_000, max_tokens=5000))
    assert job.worker_id == "attached"


def test_a_non_streamed_answer_failed_retryably_goes_on_from_its_progress() -> None:
    """``queue.failure``: the progress of a non-streamed answer is kept when its next run
    finds its backend not serving (it used to run again from the start here, and go on on a
    pull worker)."""
    dispatcher = memory_dispatcher()
    first = connect(dispatcher, "first", (Endpoint.CHAT,))
    job = dispatcher.submit(Submission(M, Endpoint.CHAT, False, {"messages": []}))
    dispatcher.workers.on_chunks(first, [(job.id, HEAD, (1, 2, 3))])  # progress only
    _starts(first)
    error = ErrorBody(message="llama-server restarting", type="server_error")
    dispatcher.workers.on_message(
        first, JobFailed(job_id=job.id, status=503, error=error, retryable=True)
    )
    [again] = _starts(first)
    assert again.resume == Continuation(tokens=(1, 2, 3), id="chatcmpl-1", created=7)
    assert job.resumes == 1 and job.requeues == 0


def test_a_non_streamed_answer_whose_only_worker_is_lost_waits_to_run_again() -> None:
    """It could go on, but no worker serves its model now: its client has nothing yet, so it
    waits to run again (a worker may come back within --max-wait) instead of failing."""
    dispatcher = memory_dispatcher()
    only = connect(dispatcher, "only", (Endpoint.CHAT,))
    job = dispatcher.submit(Submission(M, Endpoint.CHAT, False, {"messages": []}))
    dispatcher.workers.on_chunks(only, [(job.id, HEAD, (1, 2, 3))])  # progress only
    dispatcher.workers.on_lost(only, "test")
    assert job.state is JobState.QUEUED and job.requeues == 1
    assert [type(e) for e in _events(job)] == [Requeued]
    back = connect(dispatcher, "back", (Endpoint.CHAT,))
    [again] = _starts(back)
    assert again.resume is None  # from the start
