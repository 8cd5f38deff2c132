"""Answers to deterministic requests, kept for a while and replayed instead of recomputed.

**What is cacheable** (``cache_key`` returns None otherwise):

* embeddings: always (no sampling);
* chat and text completions: greedy decoding (``temperature`` a number <= 0, which llama.cpp
  decodes greedily, any ``n`` giving identical choices), or a fixed ``seed`` (an integer >= 0;
  llama.cpp reads -1 as "random") with a single choice (``n`` 1 or absent): ``n`` > 1 with
  sampling draws different choices. A missing ``temperature`` means the backend's default
  (sampling), so it needs a seed. A ``bool`` is not a number here.

**The key** is the SHA-256 of canonical JSON (``orjson`` with sorted keys, at every depth) of:
a format version, the endpoint, the model (after the router's default is applied, so naming
the default model and naming none share entries), the *mode* (below), an optional scope (the
API key id, so one key's hits do not reveal another key's prompts), and the body without the
fields that do not change the answer: ``stream``, ``stream_options`` (folded into the mode),
``user`` and ``model``. Every other field is part of the key; ``0`` and ``0.0`` differ.

**Modes.** A streamed answer and a JSON answer are different bytes, and turning one into the
other loses detail (tool-call deltas, logprobs, usage placement), so each is cached apart: the
mode is ``json``, or ``sse`` plus the request's ``stream_options`` (``include_usage`` adds a
usage chunk to the stream). A streamed request is answered only from a streamed entry and a JSON
request only from a JSON one.

**Entries** (``CachedAnswer``) hold the JSON body or the streamed ``data:`` payloads in order
(without ``[DONE]``), nothing else: no ``x-request-id`` or ``x-shoal-worker`` header; a replay
gets a fresh request id. The answer's own fields (its ``id``, ``created``) replay as they were.
Only answers that ended well are stored (``Result``, or a stream ending in ``Done``); a stream
cut by an error is not. ``replay`` answers a hit with ``x-shoal-cache: hit``; the relay marks a
cacheable request that missed with ``x-shoal-cache: miss``.

Two stores behind ``ResultCache``: ``memory.py`` (this router's LRU) and ``redis.py`` (shared
by every router). A cache failure never fails a request: the Redis store treats an unreachable
Redis as a miss and drops the write, logging the outage once.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard

import orjson
from starlette.responses import Response

from shoal.protocol.messages import Endpoint

log = logging.getLogger(__name__)

CACHE_HEADER = "x-shoal-cache"
HIT = "hit"
MISS = "miss"
KEY_VERSION = 1
IGNORED_FIELDS = frozenset({"stream", "stream_options", "user", "model"})
"""Body fields that do not change the answer (``stream*`` decide the mode instead)."""
MAX_ENTRY_CHARS = 1024 * 1024
"""An answer longer than this (characters; about bytes, as JSON is mostly ASCII) is not cached:
it would crowd out many small ones."""

# ---------------------------------------------------------------- keys (pure)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_deterministic(endpoint: Endpoint, body: Mapping[str, Any]) -> bool:
    """Whether the same request must get the same answer (see the module docstring)."""
    if endpoint is Endpoint.EMBEDDINGS:
        return True
    temperature = body.get("temperature")
    if _is_number(temperature) and temperature <= 0:
        return True
    seed = body.get("seed")
    fixed_seed = isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0
    n = body.get("n")
    return fixed_seed and (n is None or (n == 1 and not isinstance(n, bool)))


def answer_mode(body: Mapping[str, Any]) -> str:
    """``json``, or ``sse`` plus the stream options that change the streamed bytes."""
    if body.get("stream") is not True:
        return "json"
    options = body.get("stream_options") or {}
    return "sse" + (orjson.dumps(options, option=orjson.OPT_SORT_KEYS).decode() if options else "")


def cache_key(
    model: str, endpoint: Endpoint, body: Mapping[str, Any], *, scope: str | None = None
) -> str | None:
    """The cache key of a checked request, or None when its answer may differ next time."""
    if not is_deterministic(endpoint, body):
        return None
    document = {
        "v": KEY_VERSION,
        "endpoint": endpoint.value,
        "model": model,
        "mode": answer_mode(body),
        "scope": scope,
        "body": {name: value for name, value in body.items() if name not in IGNORED_FIELDS},
    }
    try:
        canonical = orjson.dumps(document, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # orjson.JSONEncodeError: not JSON data (a parsed body always is)
        return None
    return hashlib.sha256(canonical).hexdigest()


@dataclass(frozen=True, slots=True)
class CachePolicy:
    read: bool = True
    write: bool = True


def cache_policy(headers: Mapping[str, str]) -> CachePolicy:
    """What the client allows: ``Cache-Control: no-cache`` skips the lookup (the fresh answer
    is still stored); ``no-store`` skips both."""
    directives = {d.strip().lower() for d in headers.get("cache-control", "").split(",")}
    if "no-store" in directives:
        return CachePolicy(read=False, write=False)
    return CachePolicy(read="no-cache" not in directives)


# ---------------------------------------------------------------- entries


@dataclass(frozen=True, slots=True)
class CachedAnswer:
    """A JSON ``body``, or the ``events`` (``data:`` payloads) of a stream; exactly one."""

    body: str | None = None
    events: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if (self.body is None) == (self.events is None):
            raise ValueError("a cached answer is a body or a stream's events, exactly one")

    @property
    def stream(self) -> bool:
        return self.events is not None

    @property
    def size(self) -> int:
        """Characters held (the body's, or all events')."""
        if self.body is not None:
            return len(self.body)
        return sum(len(e) for e in self.events or ())

    def dumps(self) -> bytes:
        return orjson.dumps({"v": KEY_VERSION, "body": self.body, "events": self.events})

    @classmethod
    def loads(cls, raw: bytes | str) -> CachedAnswer | None:
        """The entry ``dumps`` wrote, or None if it is from another version or damaged."""
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(data, dict) or data.get("v") != KEY_VERSION:
            return None
        body, events = data.get("body"), data.get("events")
        if body is not None and events is None and isinstance(body, str):
            return cls(body=body)
        if body is None and isinstance(events, list) and all(isinstance(e, str) for e in events):
            return cls(events=tuple(events))
        return None


# ---------------------------------------------------------------- replay

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def sse_bytes(answer: CachedAnswer) -> bytes:
    """The stream as the relay sent it: each payload as a ``data:`` event, then ``[DONE]``."""
    if answer.events is None:
        raise ValueError("this cached answer is a JSON body, not a stream")
    return b"".join(b"data: " + e.encode() + b"\n\n" for e in answer.events) + b"data: [DONE]\n\n"


def json_bytes(answer: CachedAnswer) -> bytes:
    if answer.body is None:
        raise ValueError("this cached answer is a stream, not a JSON body")
    return answer.body.encode()


def new_request_id() -> str:
    """A request id for an answer served from the cache (no dispatcher job was made)."""
    return "cache_" + secrets.token_hex(8)


def replay(answer: CachedAnswer, *, stream: bool, request_id: str | None = None) -> Response:
    """The response for a cache hit, in the mode the request asked for (which the key fixed)."""
    headers = {CACHE_HEADER: HIT, "x-request-id": request_id or new_request_id()}
    if stream:
        content = sse_bytes(answer)
        return Response(content, media_type="text/event-stream", headers={**headers, **SSE_HEADERS})
    return Response(json_bytes(answer), media_type="application/json", headers=headers)


# ---------------------------------------------------------------- stores


class ResultCache(Protocol):
    async def get(self, key: str) -> CachedAnswer | None: ...

    async def put(self, key: str, answer: CachedAnswer) -> None: ...


# ---------------------------------------------------------------- filling


class CacheFill:
    """Collects a cacheable job's answer as the relay sends it; stores it if it ends well.

    The relay calls ``data`` for each streamed payload and ``await finish_stream()`` after
    ``Done``, or ``await finish_body(body)`` for a ``Result``. A ``Failed`` needs no call: an
    unfinished fill stores nothing. Past ``max_chars`` it stops collecting and stores nothing.
    """

    def __init__(
        self, cache: ResultCache, key: str, *, stream: bool, max_chars: int = MAX_ENTRY_CHARS
    ) -> None:
        self.cache = cache
        self.key = key
        self.stream = stream
        self.max_chars = max_chars
        self._events: list[str] | None = [] if stream else None
        self._size = 0

    def data(self, payload: str) -> None:
        if self._events is None:
            return
        self._size += len(payload)
        if self._size > self.max_chars:
            self._events = None  # too large to keep; the answer itself goes on
            return
        self._events.append(payload)

    async def finish_stream(self) -> None:
        if self._events is not None:
            await self.cache.put(self.key, CachedAnswer(events=tuple(self._events)))
            self._events = None

    async def finish_body(self, body: str) -> None:
        if not self.stream and len(body) <= self.max_chars:
            await self.cache.put(self.key, CachedAnswer(body=body))
