"""Exact resumption of an answer: which tokens the client has, and how a worker goes on.

Two halves, both pure (no I/O):

``TokenTrail`` follows one stream from llama-server and says, with each chunk, the ids of the
tokens whose text the client now has (``Chunk.tokens``). llama-server names a streamed token's
id only in its log-probabilities, so the worker asks for one (``n_probs: 1``, after sampling:
cheap) and strips them again when the client did not ask. Text and ids do not always travel
together (llama-server holds back a partial stop word or an incomplete UTF-8 character, the
chat parser may hold back text), so an id is released only when the text the client got is
exactly the text of the ids released; a chunk after which that is not so carries None.

``continuation`` builds what a worker asks llama-server to go on with an answer another worker
began: a raw completion (``/v1/completions``) whose prompt is the original prompt followed by
the produced token ids (a mixed prompt: llama-server tokenizes the leading string exactly as
it would the original, with its special tokens, and takes the ids as they are). For a chat
the original prompt is llama-server's own rendering of the messages (``/apply-template``).
``Splice`` turns that completion's chunks into the rest of the client's stream: the same
id and creation time, chat chunks for a chat, usage counting the prompt once and every
completion token. ``WholeAnswer`` does the same for a non-streamed answer: its ids go to
the router as progress the client does not get, and the worker going on puts the text of
the ids before the rest, so that the client gets one whole answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from shoal.protocol.messages import Continuation, Endpoint
from shoal.worker.text.aggregate import aggregate

_LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "n_predict")
_CHAT_ONLY = (
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "chat_template_kwargs",
    "reasoning_format",
    "add_generation_prompt",
    "continue_final_message",
)


class NotResumable(ValueError):
    """The request has a shape a continuation cannot reproduce exactly."""


# ---------------------------------------------------------------- the client's side


def client_wants_logprobs(body: dict[str, Any], endpoint: Endpoint) -> bool:
    if endpoint is Endpoint.CHAT:
        return bool(body.get("logprobs"))
    return body.get("logprobs") is not None or bool(body.get("n_probs"))


def with_token_ids(body: dict[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    """``body`` asking llama-server to name each streamed token (unchanged when the client
    asked for log-probabilities itself: they carry the ids)."""
    if client_wants_logprobs(body, endpoint):
        return body
    return {**body, "n_probs": 1, "post_sampling_probs": True}


@dataclass(slots=True)
class TokenTrail:
    """One stream's tokens against its text (see the module's docstring)."""

    strip: bool
    """The client did not ask for log-probabilities: remove them from what it gets."""
    chat: bool
    ids: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    """Where each id's text ends, in bytes of the whole answer."""
    id_bytes: bytearray = field(default_factory=bytearray)
    text: bytearray = field(default_factory=bytearray)
    released: int = 0
    """Ids already reported (``Chunk.tokens``)."""
    lost: bool = False
    """The text left the ids' text (a tool call, reasoning, a rewrite): never exact again."""

    def follow(self, chunk: dict[str, Any]) -> tuple[int, ...] | None:
        """Take one chunk (stripping its log-probabilities if asked); the ids it completes."""
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            self._take_logprobs(choice)
            self._take_text(choice)
        return self._release()

    def _take_logprobs(self, choice: dict[str, Any]) -> None:
        logprobs = choice.get("logprobs")
        if self.strip and "logprobs" in choice:
            if self.chat:
                del choice["logprobs"]
            else:
                choice["logprobs"] = None
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        for entry in content or ():
            token, piece = entry.get("id"), entry.get("bytes")
            if not isinstance(token, int) or not isinstance(piece, list):
                self.lost = True
                return
            self.ids.append(token)
            self.id_bytes += bytes(piece)
            self.ends.append(len(self.id_bytes))

    def _take_text(self, choice: dict[str, Any]) -> None:
        if self.chat:
            delta = choice.get("delta") or {}
            if any(delta.get(k) for k in ("tool_calls", "reasoning_content", "function_call")):
                self.lost = True
            text = delta.get("content")
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            self.text += text.encode()

    def _release(self) -> tuple[int, ...] | None:
        if self.lost or not self.id_bytes.startswith(self.text):
            self.lost = True
            return None
        n = self.released
        while n < len(self.ids) and self.ends[n] <= len(self.text):
            n += 1
        covered = self.ends[n - 1] if n else 0
        if covered != len(self.text):
            return None  # the client has part of a token's text: not a point to resume from
        out = tuple(self.ids[self.released : n])
        self.released = n
        return out


# ---------------------------------------------------------------- going on


def remaining_tokens(body: dict[str, Any], produced: int) -> int | None:
    """What is left of the request's token limit (None: it set none)."""
    for key in _LIMIT_KEYS:
        limit = body.get(key)
        if isinstance(limit, int) and limit >= 0:
            return limit - produced
    return None


def continuation(
    body: dict[str, Any], endpoint: Endpoint, resume: Continuation, chat_prompt: str | None
) -> dict[str, Any]:
    """The ``/v1/completions`` body that goes on from ``resume`` (``chat_prompt``: the chat's
    messages as llama-server renders them). Raises ``NotResumable``."""
    if (body.get("n") or 1) != 1:
        raise NotResumable("only one choice can be resumed")
    ids = list(resume.tokens)
    if endpoint is Endpoint.CHAT:
        if chat_prompt is None:
            raise NotResumable("a chat needs its rendered prompt")
        prompt: list[Any] = [chat_prompt, *ids]
    else:
        original = body.get("prompt")
        if isinstance(original, str):
            prompt = [original, *ids]
        elif isinstance(original, list) and all(type(t) is int for t in original):
            prompt = [*original, *ids]
        elif isinstance(original, list) and len(original) == 1 and isinstance(original[0], str):
            prompt = [original[0], *ids]
        else:
            raise NotResumable("only a single prompt can be resumed")
    out = {k: v for k, v in body.items() if k not in _CHAT_ONLY and k not in _LIMIT_KEYS}
    out.pop("stream_options", None)
    out.pop("top_logprobs", None)
    out.pop("logprobs", None)
    out.update(prompt=prompt, stream=True, cache_prompt=True)  # (on ``prefill_prompts``)
    left = remaining_tokens(body, len(ids))
    if left is not None:
        out["max_tokens"] = left
    if client_wants_logprobs(body, endpoint):
        top = body.get("top_logprobs") if endpoint is Endpoint.CHAT else body.get("logprobs")
        out["n_probs"] = top if isinstance(top, int) and top > 0 else 1
    else:
        out.update(n_probs=1, post_sampling_probs=True)
    return out


EXACT_BATCH = 32
"""The most produced tokens llama-server is given to evaluate at once when going on. The CPU
backend computes attention for a batch of 64 query rows or more another way (tiled, in F32)
than for a few rows or one generated token (row by row, in F16): a prefix read back in one
large batch rounds differently from the run that generated it, and a near-tie can flip
(``benchmarks/resume_exactness.py``). Under 64 rows a row's result does not depend on the
batch, so the produced ids are fed in steps this size."""


def prefill_prompts(prompt: list[Any], produced: int, step: int = EXACT_BATCH) -> list[list[Any]]:
    """The prompts evaluated (``n_predict: 0``, into the slot's cache) before the
    continuation ``prompt`` (ending with ``produced`` ids), so that each reaches llama-server
    as it did in the original run: the original prompt alone first (the batches its run
    read it in), then the produced ids at most ``step`` at a time; the continuation itself
    evaluates the last ``step`` or fewer."""
    head = len(prompt) - produced
    return [prompt[: head + k] for k in range(0, produced, step)]


def template_request(body: dict[str, Any]) -> dict[str, Any]:
    """The ``/apply-template`` body rendering a chat request's prompt as its run did."""
    return {k: v for k, v in body.items() if k not in _LIMIT_KEYS and k != "stream"}


@dataclass(slots=True)
class Splice:
    """Makes a continuation's chunks the rest of the client's stream."""

    endpoint: Endpoint
    resume: Continuation
    include_usage: bool
    """A chat client asked for the usage chunk (``stream_options.include_usage``)."""

    @property
    def produced(self) -> int:
        return len(self.resume.tokens)

    def chunks(self, chunk: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The client's chunks for one chunk of the continuation (perhaps none)."""
        self._fix_counts(chunk)
        if self.endpoint is not Endpoint.CHAT:
            self._same_ids(chunk)
            yield chunk
            return
        yield from self._as_chat(chunk)

    def _same_ids(self, chunk: dict[str, Any]) -> None:
        if self.resume.id is not None:
            chunk["id"] = self.resume.id
        if self.resume.created is not None:
            chunk["created"] = self.resume.created

    def _fix_counts(self, chunk: dict[str, Any]) -> None:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            prompt = usage["prompt_tokens"] = usage.get("prompt_tokens", 0) - self.produced
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.produced
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                details["cached_tokens"] = min(details["cached_tokens"], prompt)
        timings = chunk.get("timings")
        if isinstance(timings, dict):
            _fix_timings(timings, self.produced)

    def _as_chat(self, chunk: dict[str, Any]) -> Iterator[dict[str, Any]]:
        head = {
            "created": chunk.get("created"),
            "id": chunk.get("id"),
            "model": chunk.get("model"),
            "system_fingerprint": chunk.get("system_fingerprint"),
            "object": "chat.completion.chunk",
        }
        self._same_ids(head)
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or ():
            text = choice.get("text") or ""
            logprobs = choice.get("logprobs")
            if text or logprobs:
                part: dict[str, Any] = {
                    "finish_reason": None,
                    "index": choice.get("index", 0),
                    "delta": {"content": text},
                }
                if logprobs:
                    part["logprobs"] = logprobs
                out.append({**head, "choices": [part]})
            if choice.get("finish_reason"):
                end = {
                    "finish_reason": choice["finish_reason"],
                    "index": choice.get("index", 0),
                    "delta": {},
                }
                out.append({**head, "choices": [end]})
        if chunk.get("usage") and self.include_usage:
            out.append({**head, "choices": [], "usage": chunk["usage"]})
        if out and chunk.get("timings"):
            out[-1]["timings"] = chunk["timings"]
        yield from out


@dataclass
class WholeAnswer:
    """A non-streamed answer assembled from llama-server's stream (``aggregate``), and its
    token ids as progress (``trail``); through ``splice``, with ``before`` (the text of the
    ids already produced), when going on with an answer another worker began."""

    trail: TokenTrail | None = None
    splice: Splice | None = None
    before: str = ""
    chunks: list[dict[str, Any]] = field(default_factory=list)
    ids: tuple[int, ...] | None = ()
    """The ids completed by the last chunk taken (None: no longer exactly known)."""
    lost: bool = False
    entries: list[dict[str, Any]] = field(default_factory=list)
    """The log-probabilities seen, one per id, when the client asked for them."""
    reported: int = 0
    """How many of ``entries`` went out as progress."""
    before_logprobs: tuple[dict[str, Any], ...] = ()
    """Those of the ids produced before (``Continuation.logprobs``), put first."""

    def take(self, chunk: dict[str, Any]) -> str | None:
        """Keep one chunk; the progress to report for it (the answer's id and creation
        time, with ``ids``; first, when the client asked for them, the log-probabilities of
        those ids: ``queue.answer.PROGRESS``), or None."""
        if self.trail is not None and not self.trail.strip:
            for choice in chunk.get("choices") or ():
                logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
                if isinstance(logprobs, dict):
                    self.entries += logprobs.get("content") or ()
        released = self.trail.follow(chunk) if self.trail is not None else ()  # (strips)
        self.chunks += [chunk] if self.splice is None else list(self.splice.chunks(chunk))
        if self.trail is not None and self.trail.lost and not self.lost:
            self.lost = True  # (a tool call, reasoning): reported once, the ids no longer do
            self.ids = None
        elif not released:
            return None  # none completed here (or text held back: the client has none yet)
        else:
            self.ids = released
        head = self.chunks[-1] if self.chunks else chunk
        progress: dict[str, Any] = {}
        if self.trail is not None and not self.trail.strip and self.ids:
            upto = self.reported + len(self.ids)
            progress["progress"] = {"logprobs": self.entries[self.reported : upto]}
            self.reported = upto
        progress.update(id=head.get("id"), created=head.get("created"))
        return orjson.dumps(progress).decode()

    def answer(self, endpoint: Endpoint) -> dict[str, Any]:
        body = aggregate(self.chunks, endpoint)
        for choice in body["choices"][:1]:
            if self.before and "message" in choice:
                message = choice["message"]
                message["content"] = self.before + (message.get("content") or "")
            elif self.before:
                choice["text"] = self.before + choice["text"]
            if self.before_logprobs:
                logprobs = choice.setdefault("logprobs", {})
                logprobs["content"] = [*self.before_logprobs, *(logprobs.get("content") or ())]
        return body


def _fix_timings(timings: dict[str, Any], produced: int) -> None:
    """llama-server's counts as if the answer had run in one go: the produced tokens were
    generated, not prompt (they are the end of the continuation's prompt: computed, or
    cached where this server had them)."""
    if isinstance(timings.get("predicted_n"), int):
        timings["predicted_n"] += produced
    computed, cached = timings.get("prompt_n"), timings.get("cache_n")
    if isinstance(computed, int) and isinstance(cached, int):
        from_computed = min(computed, produced)
        timings["prompt_n"] = computed - from_computed
        timings["cache_n"] = max(cached - (produced - from_computed), 0)
