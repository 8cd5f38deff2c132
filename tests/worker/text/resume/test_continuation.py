"""Going on with an answer another worker began: the token trail, the continuation request,
and, against a real llama-server, that the continued text is exactly the uninterrupted one."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

import http_calls
from cluster import plain_llama_server
from shoal.jobs.answer import AnswerSoFar
from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import (
    Continuation,
    Endpoint,
    JobDone,
    JobFailed,
    JobResult,
    JobStart,
)
from shoal.worker.jobs.sink import JobOutcome
from shoal.worker.text.backend import Backend, BackendTarget
from shoal.worker.text.resume.continuation import (
    NotResumable,
    Splice,
    TokenTrail,
    WholeAnswer,
    continuation,
    prefill_prompts,
    with_token_ids,
)

MODEL = "m"
TOKENS = 120


def _lp(*pieces: tuple[int, bytes]) -> dict[str, Any]:
    return {"content": [{"id": i, "bytes": list(b), "logprob": 0.0} for i, b in pieces]}


def _text_chunk(text: str, *pieces: tuple[int, bytes]) -> dict[str, Any]:
    return {"choices": [{"text": text, "index": 0, "logprobs": _lp(*pieces) if pieces else None}]}


def _chat_chunk(delta: dict[str, Any], *pieces: tuple[int, bytes]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
    if pieces:
        choice["logprobs"] = _lp(*pieces)
    return {"choices": [choice]}


# ---------------------------------------------------------------- the trail (pure)


def test_ids_are_released_only_when_the_text_has_caught_up() -> None:
    trail = TokenTrail(strip=True, chat=False)
    assert trail.follow(_text_chunk("He", (1, b"He"))) == (1,)
    held = _text_chunk("", (2, b"ll"))  # held back (a partial stop word, say)
    assert trail.follow(held) == ()  # the client has the text of id 1, exactly: resumable
    assert held["choices"][0]["logprobs"] is None  # stripped: the client did not ask
    assert trail.follow(_text_chunk("llo", (3, b"o"))) == (2, 3)
    assert trail.follow(_text_chunk("")) == ()


def test_a_character_split_over_two_tokens_is_released_with_its_second_half() -> None:
    trail = TokenTrail(strip=False, chat=True)
    e_acute = "é".encode()
    chunk = _chat_chunk({"content": ""}, (7, e_acute[:1]))
    assert trail.follow(chunk) == ()
    assert "logprobs" in chunk["choices"][0]  # the client asked: kept
    assert trail.follow(_chat_chunk({"content": "é"}, (8, e_acute[1:]))) == (7, 8)


def test_text_the_ids_do_not_explain_makes_the_trail_lost_for_good() -> None:
    trail = TokenTrail(strip=True, chat=True)
    assert trail.follow(_chat_chunk({"role": "assistant", "content": None})) == ()
    assert trail.follow(_chat_chunk({"content": "Hi"})) is None  # no ids came with it
    assert trail.follow(_chat_chunk({"content": " there"}, (1, b"Hi"), (2, b" there"))) is None
    tools = TokenTrail(strip=True, chat=True)
    assert tools.follow(_chat_chunk({"tool_calls": [{"index": 0}]}, (3, b"{"))) is None
    assert tools.lost


@given(st.lists(st.binary(min_size=1, max_size=4), min_size=1, max_size=30), st.data())
def test_released_ids_always_spell_exactly_the_text_sent(
    pieces: list[bytes], data: st.DataObject
) -> None:
    """Whatever the grouping of text into chunks, the ids released spell the text sent."""
    whole = b"".join(pieces)
    trail = TokenTrail(strip=True, chat=False)
    released: list[int] = []
    sent = 0
    for i, piece in enumerate(pieces):
        upto = data.draw(st.integers(sent, len(whole[: sum(map(len, pieces[: i + 1]))])))
        text = whole[sent:upto]
        try:
            text_str = text.decode()
        except UnicodeDecodeError:
            continue  # llama-server never sends half a character
        sent = upto
        ids = trail.follow(_text_chunk(text_str, (i, piece)))
        if ids is not None:
            released += ids
            assert b"".join(pieces[j] for j in released) == whole[:sent]


# ---------------------------------------------------------------- the request (pure)


def test_the_continuation_asks_for_the_prompt_then_the_produced_ids() -> None:
    resume = Continuation(tokens=(5, 6, 7), id="cmpl-1", created=100)
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body = continuation(chat, Endpoint.CHAT, resume, "<|im_start|>user\nhi")
    assert body["prompt"] == ["<|im_start|>user\nhi", 5, 6, 7]
    assert body["max_tokens"] == 7 and body["temperature"] == 0
    assert "messages" not in body and "stream_options" not in body
    assert body["n_probs"] == 1 and body["post_sampling_probs"] is True
    text = continuation(
        {"prompt": [1, 2], "max_completion_tokens": 4}, Endpoint.COMPLETIONS, resume, None
    )
    assert text["prompt"] == [1, 2, 5, 6, 7] and text["max_tokens"] == 1
    with pytest.raises(NotResumable):
        continuation({"prompt": ["a", "b"]}, Endpoint.COMPLETIONS, resume, None)
    with pytest.raises(NotResumable):
        continuation({**chat, "n": 2}, Endpoint.CHAT, resume, "p")
    asked = with_token_ids({"logprobs": True, "top_logprobs": 3}, Endpoint.CHAT)
    assert "n_probs" not in asked


def test_the_splice_makes_completion_chunks_the_rest_of_a_chat_stream() -> None:
    resume = Continuation(tokens=(1, 2), id="chatcmpl-orig", created=42)
    splice = Splice(Endpoint.CHAT, resume, include_usage=True)
    assert list(splice.chunks({"id": "x", "created": 9, "choices": [{"text": ""}]})) == []
    [mid] = splice.chunks({"id": "x", "created": 9, "model": MODEL, "choices": [{"text": "a"}]})
    assert mid["id"] == "chatcmpl-orig" and mid["created"] == 42
    assert mid["object"] == "chat.completion.chunk"
    assert mid["choices"][0]["delta"] == {"content": "a"}
    last = {
        "choices": [{"text": "b", "finish_reason": "length", "index": 0}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
        "timings": {"predicted_n": 3, "prompt_n": 1, "cache_n": 11},
    }
    content, end, usage = splice.chunks(last)
    assert content["choices"][0]["delta"] == {"content": "b"}
    assert end["choices"][0] == {"finish_reason": "length", "index": 0, "delta": {}}
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
    }
    # llama-server's counts as if it had run in one go: 10 prompt tokens, 5 generated
    assert usage["timings"] == {"predicted_n": 5, "prompt_n": 0, "cache_n": 10}


def test_a_whole_answer_reports_its_ids_as_progress_until_they_no_longer_spell_it() -> None:
    whole = WholeAnswer(TokenTrail(strip=True, chat=True))
    head = {"id": "chatcmpl-1", "created": 7}
    assert whole.take({**head, **_chat_chunk({"role": "assistant", "content": None})}) is None
    progress = whole.take({**head, **_chat_chunk({"content": "Hi"}, (5, b"Hi"))})
    assert progress is not None and orjson.loads(progress) == head and whole.ids == (5,)
    assert whole.take(_chat_chunk({"content": ""}, (6, b" t"))) is None  # text held back
    assert whole.take(_chat_chunk({"content": " t"})) is not None and whole.ids == (6,)
    assert whole.take(_chat_chunk({"tool_calls": [{"index": 0}]}, (8, b"{"))) is not None
    assert whole.ids is None  # reported once: the ids no longer spell the answer
    assert whole.take(_chat_chunk({"content": "x"}, (9, b"x"))) is None
    [choice] = whole.answer(Endpoint.CHAT)["choices"]
    assert choice["message"]["content"] == "Hi tx" and "logprobs" not in choice


def test_a_whole_answer_that_goes_on_puts_the_text_before_first() -> None:
    resume = Continuation(tokens=(1, 2), id="cmpl-orig", created=3)
    splice = Splice(Endpoint.COMPLETIONS, resume, include_usage=True)
    whole = WholeAnswer(TokenTrail(strip=True, chat=False), splice, "Once upon")
    whole.take({"id": "x", "created": 9, **_text_chunk(" a", (3, b" a"))})
    end = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}]}
    whole.take({"id": "x", "created": 9, **end, "usage": {"prompt_tokens": 12}})
    answer = whole.answer(Endpoint.COMPLETIONS)
    assert answer["id"] == "cmpl-orig" and answer["created"] == 3
    assert answer["choices"][0]["text"] == "Once upon a"
    assert answer["usage"] == {"prompt_tokens": 10, "completion_tokens": 2}


# ---------------------------------------------------------------- a real llama-server


def _serve(
    llama_server: Path, model_path: Path, tmp: pytest.TempPathFactory, *extra: str
) -> Iterator[str]:
    args = ["--alias", MODEL, "-np", "1", "-c", "2048", "--threads", "1", "--no-webui"]
    args += ["--cache-ram", "0", "--slot-save-path", str(tmp.mktemp("slots")), *extra]
    log = tmp.mktemp("llama") / "llama.log"  # (the slot-save path: to erase the slot)
    with plain_llama_server(llama_server, model_path, log, *args) as url:
        yield url


@pytest.fixture(scope="module")
def llama_url(
    llama_server: Path, model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    yield from _serve(llama_server, model_path, tmp_path_factory)


class ListSink:
    def __init__(self) -> None:
        self.chunks: list[tuple[dict[str, Any], tuple[int, ...] | None]] = []
        self.outcomes: list[JobOutcome] = []

    def chunk(self, job_id: JobId, data: str, tokens: tuple[int, ...] | None = None) -> None:
        self.chunks.append((orjson.loads(data), tokens))

    def send(self, message: JobOutcome, /) -> None:
        self.outcomes.append(message)


def _forget(llama_url: str) -> None:
    """Empty the slot's cache: the next request is evaluated as on another worker."""
    http_calls.post(f"{llama_url}/slots/0?action=erase").raise_for_status()


@pytest.fixture
async def backend(llama_url: str) -> AsyncIterator[Backend]:
    async with aiohttp.ClientSession() as session:
        target = BackendTarget(MODEL, stream_upstream=True, token_ids=True)
        yield Backend(target, session, lambda: llama_url)


def _text(chunks: list[tuple[dict[str, Any], tuple[int, ...] | None]], chat: bool) -> str:
    out = ""
    for chunk, _ in chunks:
        for choice in chunk.get("choices") or ():
            out += (choice.get("delta", {}).get("content") if chat else choice.get("text")) or ""
    return out


def _cut(sink: ListSink, at: int) -> tuple[list[Any], list[int]]:
    """The chunks a client had when the worker was lost after chunk ``at``, and their ids."""
    had = sink.chunks[:at]
    ids = [t for _, tokens in had for t in tokens or ()]
    assert had[-1][1] is not None, "a cut where the ids are exactly known"
    return had, ids


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS])
async def test_going_on_gives_exactly_the_uninterrupted_answer(
    backend: Backend, llama_url: str, endpoint: Endpoint
) -> None:
    """From a fresh slot, as on another worker; the late cuts put 64 tokens or more before
    the continuation, which, read back in one batch, diverged (``prefill_prompts``)."""
    chat = endpoint is Endpoint.CHAT
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [
            {"role": "user", "content": "Explain how a hash map works, with an example."}
        ]
    else:
        body["prompt"] = "Once upon a time, in a village by the sea,"
    job = JobStart(
        job_id=JobId("j1"), model=ModelName(MODEL), endpoint=endpoint, stream=True, body=body
    )
    whole = ListSink()
    await backend.run(job, whole)
    assert whole.outcomes == [JobDone(job_id=JobId("j1"))]
    assert all(
        "logprobs" not in c or c["logprobs"] is None
        for chunk, _ in whole.chunks
        for c in chunk["choices"]
    )
    ids = [t for _, tokens in whole.chunks for t in tokens or ()]
    assert len(ids) == TOKENS  # every generated token is named, once
    expected = _text(whole.chunks, chat)
    first = whole.chunks[0][0]
    for at in (3, 40, 60, 76):
        had, produced = _cut(whole, at)
        _forget(llama_url)
        resume = Continuation(tokens=tuple(produced), id=first["id"], created=first["created"])
        rest = ListSink()
        again = job.model_copy(update={"job_id": JobId("j2"), "resume": resume, "attempt": 2})
        await backend.run(again, rest)
        assert rest.outcomes == [JobDone(job_id=JobId("j2"))]
        assert _text(had, chat) + _text(rest.chunks, chat) == expected
        assert all(chunk["id"] == first["id"] for chunk, _ in rest.chunks)
        roles = [
            c for chunk, _ in rest.chunks for c in chunk["choices"] if "role" in c.get("delta", {})
        ]
        assert roles == []
        [usage] = [chunk["usage"] for chunk, _ in rest.chunks if chunk.get("usage")]
        [original] = [chunk["usage"] for chunk, _ in whole.chunks if chunk.get("usage")]
        assert usage["prompt_tokens"] == original["prompt_tokens"]
        assert usage["completion_tokens"] == TOKENS == original["completion_tokens"]
        [timings] = [chunk["timings"] for chunk, _ in rest.chunks if chunk.get("timings")]
        assert timings["predicted_n"] == TOKENS
        assert timings["prompt_n"] + timings["cache_n"] == original["prompt_tokens"]
        finish = [
            c["finish_reason"]
            for chunk, _ in rest.chunks
            for c in chunk["choices"]
            if c.get("finish_reason")
        ]
        assert finish == ["length"]


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS])
async def test_a_non_streamed_answer_goes_on_and_comes_whole(
    backend: Backend, endpoint: Endpoint
) -> None:
    """Its ids come as progress; going on from any of them gives the uninterrupted answer,
    with the first run's id and creation time."""
    chat = endpoint is Endpoint.CHAT
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": "Write a poem about the sea. ✨"}]
    else:
        body["prompt"] = "Once upon a time, in a village by the sea,"
    job = JobStart(
        job_id=JobId("j1"), model=ModelName(MODEL), endpoint=endpoint, stream=False, body=body
    )
    whole = ListSink()
    await backend.run(job, whole)
    [result] = whole.outcomes
    assert isinstance(result, JobResult)
    expected = orjson.loads(result.body)
    assert "logprobs" not in expected["choices"][0] or expected["choices"][0]["logprobs"] is None
    ids = [t for _, tokens in whole.chunks for t in tokens or ()]
    assert len(ids) == 40  # every generated token is named, once
    head = whole.chunks[0][0]
    assert head == {"id": expected["id"], "created": expected["created"]}
    for at in (1, 10, len(whole.chunks) - 1):
        _, produced = _cut(whole, at)
        resume = Continuation(tokens=tuple(produced), id=head["id"], created=head["created"])
        rest = ListSink()
        again = job.model_copy(update={"job_id": JobId("j2"), "resume": resume, "attempt": 2})
        await backend.run(again, rest)
        [done] = rest.outcomes
        assert isinstance(done, JobResult)
        answer = orjson.loads(done.body)
        assert (answer["id"], answer["created"]) == (expected["id"], expected["created"])
        assert answer["choices"] == expected["choices"]
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert {k: answer["usage"][k] for k in counts} == {k: expected["usage"][k] for k in counts}
        assert answer["timings"]["predicted_n"] == 40


async def test_a_request_that_cannot_go_on_fails_as_a_lost_worker(backend: Backend) -> None:
    body = {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 5, "stream": True}
    job = JobStart(
        job_id=JobId("j3"),
        model=ModelName(MODEL),
        endpoint=Endpoint.COMPLETIONS,
        stream=True,
        body=body,
        resume=Continuation(tokens=(1,)),
    )
    sink = ListSink()
    await backend.run(job, sink)
    [failed] = sink.outcomes
    assert isinstance(failed, JobFailed) and failed.error.code == "worker_lost"


async def test_a_chat_that_asked_for_logprobs_gets_them_from_the_continuation(
    backend: Backend,
) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 30,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 2,
        "messages": [{"role": "user", "content": "Name three rivers."}],
    }
    job = JobStart(
        job_id=JobId("j4"), model=ModelName(MODEL), endpoint=Endpoint.CHAT, stream=True, body=body
    )
    whole = ListSink()
    await backend.run(job, whole)
    had, produced = _cut(whole, 10)
    first = whole.chunks[0][0]
    resume = Continuation(tokens=tuple(produced), id=first["id"], created=first["created"])
    rest = ListSink()
    await backend.run(job.model_copy(update={"resume": resume}), rest)
    entries = [
        entry
        for chunk, _ in rest.chunks
        for choice in chunk["choices"]
        for entry in (choice.get("logprobs") or {}).get("content") or ()
    ]
    assert len(entries) == 30 - len(produced)
    assert all(len(entry["top_logprobs"]) == 2 and "logprob" in entry for entry in entries)
    assert "".join(entry["token"] for entry in entries) == _text(rest.chunks, True)
    assert _text(had, True) + _text(rest.chunks, True) == _text(whole.chunks, True)


@given(st.integers(1, 5), st.integers(0, 300), st.integers(1, 64))
def test_prefill_feeds_the_produced_ids_a_step_at_a_time(
    head: int, produced: int, step: int
) -> None:
    prompt: list[Any] = ["p"] * head + list(range(produced))
    steps = prefill_prompts(prompt, produced, step)
    assert (steps[0] == prompt[:head]) if produced else steps == []
    lengths = [len(p) for p in steps] + [len(prompt)]
    assert all(0 < b - a <= step for a, b in zip(lengths, lengths[1:], strict=False))
    assert all(prompt[: len(p)] == p for p in steps)


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS])
async def test_a_non_streamed_answer_with_logprobs_goes_on_with_them(
    backend: Backend, llama_url: str, endpoint: Endpoint
) -> None:
    """Its progress carries the log-probabilities of its ids; going on (from a fresh slot,
    as on another worker) puts them before the rest's: the uninterrupted answer, logprobs
    and all."""
    chat = endpoint is Endpoint.CHAT
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    if chat:
        body.update(messages=[{"role": "user", "content": "Name three rivers."}])
        body.update(logprobs=True, top_logprobs=2)
    else:
        body.update(prompt="Once upon a time, in a village by the sea,", logprobs=2)
    job = JobStart(
        job_id=JobId("j5"), model=ModelName(MODEL), endpoint=endpoint, stream=False, body=body
    )
    whole = ListSink()
    await backend.run(job, whole)
    [result] = whole.outcomes
    assert isinstance(result, JobResult)
    expected = orjson.loads(result.body)
    assert len(expected["choices"][0]["logprobs"]["content"]) == 40
    for at in (8, len(whole.chunks) - 2):
        _, produced = _cut(whole, at)
        entries = [
            entry
            for chunk, tokens in whole.chunks[:at]
            if tokens
            for entry in chunk["progress"]["logprobs"]
        ]
        assert len(entries) == len(produced)
        head = whole.chunks[0][0]
        resume = Continuation(
            tokens=tuple(produced), id=head["id"], created=head["created"], logprobs=tuple(entries)
        )
        _forget(llama_url)
        rest = ListSink()
        await backend.run(job.model_copy(update={"resume": resume, "attempt": 2}), rest)
        [done] = rest.outcomes
        assert isinstance(done, JobResult)
        assert orjson.loads(done.body)["choices"] == expected["choices"]


# ---------------------------------------------------------------- tool calls do not go on

TOOL_TEMPLATE = Path(__file__).parent / "data" / "qwen2.5-tools.jinja"
"""A chat template with tools (Qwen2.5's, from llama.cpp's ``models/templates``): the default
model's own template has none, so llama-server parses no tool call with it."""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}


@pytest.fixture(scope="module")
def tool_llama_url(
    llama_server: Path, model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    yield from _serve(
        llama_server, model_path, tmp_path_factory, "--chat-template-file", str(TOOL_TEMPLATE)
    )


def _tool_call_body() -> dict[str, Any]:
    """A streamed answer that is a tool call. ``tool_choice: required`` alone does not make
    the default model call (llama-server's grammar admits text before the call, and it writes
    text): its turn is begun with the call's opening tag."""
    return {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": "What is the weather in Paris for the next 3 days?"},
            {"role": "assistant", "content": "<tool_call>\n"},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def test_a_streamed_tool_call_does_not_name_its_tokens_so_it_does_not_go_on(
    tool_llama_url: str,
) -> None:
    """llama-server names a streamed token (in its log-probabilities) only on a chunk that
    carries a delta (``to_json_oaicompat_chat`` of a partial result), and most of a tool
    call's tokens carry none (its markup, and its name until its arguments begin), so the
    ids of a tool-call answer are not known: its trail is lost from the first tool-call delta
    and a lost worker ends it with ``worker_lost`` (``AnswerSoFar.continuation`` is None).
    Should the count below start to match, llama-server names every token: see "Why tool
    calls and reasoning do not go on" in docs/architecture.md."""
    async with aiohttp.ClientSession() as session:
        target = BackendTarget(MODEL, stream_upstream=True, token_ids=True)
        backend = Backend(target, session, lambda: tool_llama_url)
        job = JobStart(
            job_id=JobId("t1"),
            model=ModelName(MODEL),
            endpoint=Endpoint.CHAT,
            stream=True,
            body=_tool_call_body(),
        )
        sink = ListSink()
        await backend.run(job, sink)
    assert sink.outcomes == [JobDone(job_id=JobId("t1"))]
    calls: dict[int, dict[str, str]] = {}
    answer = AnswerSoFar()
    in_call = False
    for chunk, tokens in sink.chunks:
        answer.take(orjson.dumps(chunk).decode(), tokens)
        for choice in chunk.get("choices") or ():
            for call in choice.get("delta", {}).get("tool_calls") or ():
                in_call = True
                got = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                got["id"] += call.get("id") or ""
                got["name"] += call.get("function", {}).get("name") or ""
                got["arguments"] += call.get("function", {}).get("arguments") or ""
        assert tokens is None or not in_call, "no id is reported once a tool call began"
    [call] = calls.values()
    assert call["name"] == "get_weather" and call["id"]
    assert orjson.loads(call["arguments"])["city"] == "Paris"
    assert answer.continuation(Endpoint.CHAT, resumes=0, resume_attempts=2) is None

    named, usage = 0, None
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream(
            "POST",
            f"{tool_llama_url}/v1/chat/completions",
            json={**_tool_call_body(), "n_probs": 1, "post_sampling_probs": True},
        ) as response,
    ):
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line.removeprefix("data: "))
            for choice in chunk.get("choices") or ():
                named += len((choice.get("logprobs") or {}).get("content") or ())
            usage = chunk.get("usage") or usage
    assert usage is not None
    assert 0 < named < usage["completion_tokens"]
