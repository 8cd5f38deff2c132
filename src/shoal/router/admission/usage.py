"""How many tokens an answer used, read from the answer itself without parsing all of it;
and the usage a client did not ask for, taken out of its stream.

OpenAI-style bodies carry ``usage``; llama-server also attaches ``timings`` (``prompt_n``,
``cache_n``, ``predicted_n``) to the last chunk of every stream, which is the only count a
streamed chat answer carries when the client did not ask for ``stream_options.include_usage``.
Other servers (vLLM, Ollama) count a stream's tokens only when asked, so a worker attached to
one always asks (``worker/text/backend.py``, ``BackendTarget.ask_usage``); the router charges the
tokens from what the worker sent and gives a client that did not ask a stream without usage
(``for_client``), as OpenAI does: no usage-only last chunk, no ``usage`` field.
"""

from __future__ import annotations

import re

import orjson

# The usage object: flat, or with one level of nesting (``prompt_tokens_details``).
_USAGE = re.compile(r'"usage"\s*:\s*(\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})')
_USAGE_KEY = '"usage"'


def usage_of(body: str) -> tuple[int, int] | None:
    """``(prompt_tokens, completion_tokens)`` from a response body or final stream chunk.

    Finds the ``"usage"`` object without parsing the whole body, which for embeddings can
    be megabytes of floats. Inside JSON strings a quote is escaped, so ``"usage"`` followed by
    a colon only occurs as a key. Embeddings have no ``completion_tokens``: 0 then. None when
    there is no well-formed usage.
    """
    end = len(body)
    while (at := body.rfind(_USAGE_KEY, 0, end)) != -1:
        match = _USAGE.match(body, at)
        if match is not None:
            return _usage_numbers(match.group(1))
        end = at
    return None


def _usage_numbers(text: str) -> tuple[int, int] | None:
    try:
        usage = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens", 0)
    if not (_count(prompt) and _count(completion)):
        return None
    return prompt, completion


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_TIMINGS = re.compile(r'"timings"\s*:\s*(\{[^{}]*\})')


def tokens_of(body: str) -> tuple[int, int] | None:
    """``(tokens in, tokens out)`` of an answer: its ``usage``, else llama-server's
    ``timings`` (prompt tokens are the ones evaluated plus those reused from the cache)."""
    usage = usage_of(body)
    if usage is not None:
        return usage
    at = body.rfind('"timings"')
    match = _TIMINGS.match(body, at) if at != -1 else None
    if match is None:
        return None
    try:
        timings = orjson.loads(match.group(1))
    except orjson.JSONDecodeError:
        return None
    prompt = timings.get("prompt_n", 0) + timings.get("cache_n", 0)
    completion = timings.get("predicted_n")
    if not (_count(prompt) and _count(completion)):
        return None
    return prompt, completion


_CACHED = re.compile(r'"cached_tokens"\s*:\s*(\d+)')
_CACHE_N = re.compile(r'"cache_n"\s*:\s*(\d+)')


def cached_of(body: str) -> int | None:
    """Prompt tokens reused from the backend's cache: ``usage.prompt_tokens_details.
    cached_tokens`` (OpenAI's field, which llama-server fills), else llama-server's
    ``timings.cache_n``; None when the answer says neither."""
    at = body.rfind(_USAGE_KEY)
    match = _USAGE.match(body, at) if at != -1 else None
    if match is not None and (cached := _CACHED.search(match.group(1))) is not None:
        return int(cached.group(1))
    at = body.rfind('"timings"')
    match = _TIMINGS.match(body, at) if at != -1 else None
    if match is not None and (cache_n := _CACHE_N.search(match.group(1))) is not None:
        return int(cache_n.group(1))
    return None


def asks_usage(body: dict[str, object]) -> bool:
    """Whether a streamed request asked for its usage (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def for_client(data: str) -> str | None:
    """A streamed chunk as a client that did not ask for usage gets it: without its
    ``usage``; None for the usage-only chunk (no choices), which it does not get at all."""
    if _USAGE_KEY not in data:  # the hot path: most chunks
        return data
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    if not isinstance(chunk, dict) or "usage" not in chunk:
        return data  # "usage" was a key deeper down
    del chunk["usage"]
    if not chunk.get("choices"):
        return None
    return orjson.dumps(chunk).decode()
