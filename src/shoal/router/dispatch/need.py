"""How much context a request needs in a worker's slot, from its body alone (pure).

A worker's llama-server refuses a prompt that does not fit its slot (``exceed_context_size_
error``, 400), and an answer stops when the slot is full. So the router places a request only
where its prompt and the tokens it asks for (``max_tokens``, ``max_completion_tokens`` or
``n_predict``; without any, llama-server generates until the slot is full, so the prompt and
one token) fit: ``WorkerLoad.fits`` in ``scheduler.pick_worker``, and with Redis the claim's
limit (``redis_queue/claim.py``). The router has no tokenizer, so it has two numbers for a
prompt, for two different decisions:

* a **bound** (``Need.floor``): fewer tokens than this no prompt of these bytes can be,
  since no token is longer than ``MAX_TOKEN_BYTES``. The router refuses a request itself
  (400, before it waits anywhere) only when even the bound does not fit the largest context
  of the workers serving its model: a certain refusal, never one of a request that would
  have fit. It is loose (a 4,096-token slot refuses only from 512 KiB of text), which is
  why it decides only this;
* an **estimate** (``Need.guess``): ``protocol.prefix.BYTES_PER_TOKEN`` bytes per token, as
  prefix routing counts. It decides where the request goes: only to workers whose context
  holds the estimate, or when none does, to those with the largest context (``tokens``): a
  request that may fit is tried where it fits best rather than refused. An estimate too
  optimistic (digits, code, other scripts take fewer bytes per token) sends a request where
  llama-server refuses it; that refusal is not the client's error: it names the prompt's
  exact length (``JobFailed.context_needed``), the job's need rises to it, and the job waits
  for a worker with more context, or gets the 400 when none has it (``running.py``).

Token-id prompts (a completion's ``prompt`` of integers) are counted exactly. Parts of a
message that are not text (images, audio) count for nothing: their tokens are not in their
bytes, so they could only make the bound wrong.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import orjson

from shoal.protocol.messages import Endpoint
from shoal.protocol.prefix import BYTES_PER_TOKEN

MAX_TOKEN_BYTES = 128
"""The longest token, in bytes, of any vocabulary Shoal serves: a prompt of ``n`` bytes of
text is at least ``n / MAX_TOKEN_BYTES`` tokens. The default model's longest is 81 bytes
(a newline and 80 spaces); the BPE vocabularies of large models stay within 128 (runs of
spaces, ``=``, ``-`` and ``#``)."""

OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict")
"""Where a request says how many tokens it may generate (``n_predict``: llama-server's own
name; -1 there means no limit; ``max_output_tokens``: the Responses API's)."""

CONTEXT_ENDPOINTS = frozenset(
    {Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES, Endpoint.MESSAGES}
)
"""The endpoints whose requests hold a slot's context; others (embeddings, images) need
none the router can bound."""


@dataclass(frozen=True, slots=True)
class Need:
    """What a request's prompt and answer take of a slot's context."""

    text_bytes: int = 0
    """The prompt's text, in bytes (message text, roles, tools)."""
    tokens: int = 0
    """The prompt's tokens known exactly (a prompt given as token ids)."""
    output: int = 0
    """The tokens it asks to generate; 0 when it names no limit (or asks for none)."""
    output_field: str | None = None
    """The field that said so, for an error's ``param``."""

    @property
    def floor(self) -> int:
        """Fewer tokens than this it cannot need: its prompt at ``MAX_TOKEN_BYTES`` a token,
        and what it generates (at least one: llama-server needs the prompt to leave room)."""
        prompt = self.tokens + math.ceil(self.text_bytes / MAX_TOKEN_BYTES)
        return prompt + max(self.output, 1)

    @property
    def guess(self) -> int:
        """What it is expected to need: its prompt at ``BYTES_PER_TOKEN`` a token, and what
        it generates."""
        prompt = self.tokens + math.ceil(self.text_bytes / BYTES_PER_TOKEN)
        return prompt + max(self.output, 1)


NO_NEED = Need()


def need_of(endpoint: Endpoint, body: Mapping[str, object]) -> Need:
    """The context a request to ``endpoint`` with ``body`` needs (``NO_NEED`` for endpoints
    that hold none). A completion with several prompts runs each in its own slot: the
    longest one counts."""
    if endpoint not in CONTEXT_ENDPOINTS:
        return NO_NEED
    if endpoint is Endpoint.CHAT:
        text, tokens = _chat_bytes(body), 0
    elif endpoint in (Endpoint.RESPONSES, Endpoint.MESSAGES):
        text, tokens = _text_bytes(body), 0
    else:
        text, tokens = _longest_prompt(body.get("prompt"))
    output, field = _output(body)
    return Need(text, tokens, output, field)


def prompt_field(endpoint: Endpoint) -> str:
    """Where a request to ``endpoint`` has its prompt (an error's ``param``)."""
    return _PROMPT_FIELDS.get(endpoint, "prompt")


_PROMPT_FIELDS = {
    Endpoint.CHAT: "messages",
    Endpoint.MESSAGES: "messages",
    Endpoint.RESPONSES: "input",
}
_TEXT_FIELDS = ("tools", "system", "instructions", "messages", "input")
"""Where a Responses or Messages request has the text its prompt is made of."""
_NOT_TEXT = frozenset({"source", "image_url", "file_data", "data"})
"""Fields whose strings are not rendered as text (images and files)."""


def largest(contexts: Iterable[int | None]) -> int | None:
    """The largest context per slot among the workers serving a model; None when one of them
    does not say (it may hold anything) or none is known."""
    most: int | None = None
    for context in contexts:
        if context is None:
            return None
        most = context if most is None else max(most, context)
    return most


def refused(need: Need, most: int | None) -> bool:
    """Certain not to fit: even its bound is more than the largest context ``most``."""
    return most is not None and need.floor > most


def tokens(need: Need, most: int | None) -> int:
    """The context a worker's slot must have to be given the request: its estimate, or when
    that is more than the largest context ``most``, ``most`` (it is tried there: only
    llama-server can tell). 0 for a request that needs none."""
    if need is NO_NEED:
        return 0
    return need.guess if most is None else min(need.guess, most)


def _chat_bytes(body: Mapping[str, object]) -> int:
    """The text of a chat's tools and messages, in bytes (roles, text content, tool calls)."""
    size = 0
    tools = body.get("tools")
    if tools:
        size += len(orjson.dumps(tools))
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        size += len(str(message.get("role", "")).encode())
        size += _content_bytes(message.get("content"))
        calls = message.get("tool_calls")
        if calls:
            size += len(orjson.dumps(calls))
    return size


def _text_bytes(body: Mapping[str, object]) -> int:
    """The text of a Responses or Messages request, in bytes: every string in its tools,
    system prompt and messages or input items (names and types included; keys, images and
    files not), each of which its template renders."""
    return sum(_strings(body.get(name)) for name in _TEXT_FIELDS)


def _strings(value: object) -> int:
    """The bytes of every string in ``value`` (walked without recursion: a body may nest as
    deep as the JSON parser allows)."""
    size, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            size += len(item.encode())
        elif isinstance(item, list):
            stack += item
        elif isinstance(item, dict):
            stack += [v for k, v in item.items() if k not in _NOT_TEXT]
    return size


def _content_bytes(content: object) -> int:
    if isinstance(content, str):
        return len(content.encode())
    if not isinstance(content, list):
        return 0
    size = 0
    for part in content:
        if isinstance(part, dict) and isinstance(text := part.get("text"), str):
            size += len(text.encode())  # other parts (images, audio): not text
    return size


def _longest_prompt(prompt: object) -> tuple[int, int]:
    """(text bytes, exact tokens) of a completion's prompt; of its longest, for several."""
    if isinstance(prompt, str):
        return len(prompt.encode()), 0
    if not isinstance(prompt, list) or not prompt:
        return 0, 0
    if any(isinstance(p, list) for p in prompt) or all(isinstance(p, str) for p in prompt):
        # several prompts (strings, or lists of ids): each runs on its own
        return max((_one_prompt(p) for p in prompt), key=_weight, default=(0, 0))
    return _one_prompt(prompt)


def _one_prompt(prompt: object) -> tuple[int, int]:
    """A prompt of text, of token ids, or of both mixed (llama-server's own form)."""
    if isinstance(prompt, str):
        return len(prompt.encode()), 0
    if not isinstance(prompt, list):
        return 0, 0
    text = sum(len(p.encode()) for p in prompt if isinstance(p, str))
    ids = sum(1 for p in prompt if isinstance(p, int) and not isinstance(p, bool))
    return text, ids


def _weight(prompt: tuple[int, int]) -> float:
    return prompt[1] + prompt[0] / BYTES_PER_TOKEN


def _output(body: Mapping[str, object]) -> tuple[int, str | None]:
    """The fewest tokens it asks for among the fields that say (llama-server reads one of
    them; the fewest never refuses what it would take), and which field; (0, None): none."""
    best: tuple[int, str | None] = (0, None)
    for name in OUTPUT_FIELDS:
        value = body.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            continue  # absent, not a number, or n_predict -1: no limit
        if best[1] is None or value < best[0]:
            best = (value, name)
    return best
