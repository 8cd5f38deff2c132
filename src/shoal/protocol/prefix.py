"""A request's prefix as the router and the worker both see it: chained block hashes.

The router cannot tokenize (it has no model), so what it matches is the request's own
content: the canonical serialization of its ``messages`` (or ``prompt``), cut into blocks of
``BLOCK_BYTES`` and hashed in a chain, each hash covering its block and every block before
it. A chat template renders messages in order, so two requests whose canonical text shares
its first ``n`` blocks share the templated prompt's leading tokens up to about there. The
worker runs this same function on every request it serves and reports the hashes its slots
hold (``worker/text/slots.py``); the router counts how many leading hashes of a new request a
worker holds (``held_blocks``). One function on both sides means no tokenizer, no template
and nothing model-specific in the router, and a match exact to the block.

Only whole blocks count, and at most ``MAX_BLOCKS`` (the first 32 KiB), which bounds what a
worker reports per slot.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping

import orjson

BLOCK_BYTES = 256
"""Canonical bytes per block: fine enough to tell a 1,000-token system prompt's end within
about 64 tokens, coarse enough that a slot's holding is a few dozen hashes."""
MAX_BLOCKS = 128
"""Blocks hashed per request: the first 32 KiB of its content."""
BYTES_PER_TOKEN = 4.0
"""What one prompt token is worth in canonical bytes, roughly (English text, BPE): the
router's conversion of matched blocks to expected cached tokens."""

_SEP = b"\x1e"  # between messages
_ROLE = b"\x1f"  # between a message's role and its content


def canonical(body: Mapping[str, object]) -> bytes:
    """The request content a prefix is made of, in the order a template renders it: the
    tools (if any), then each message's role and content; or a completion's ``prompt``.
    A Messages (Anthropic) request's ``system`` and a Responses request's ``instructions``
    come first, as a system message; a Responses request's ``input`` items are its
    messages (an item without ``content``, such as a tool call, as a whole)."""
    out = bytearray()
    tools = body.get("tools")
    if tools:
        out += _dumps(tools) + _SEP
    messages = _messages(body)
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            out += str(message.get("role", "")).encode() + _ROLE
            content = message.get("content")
            if isinstance(content, str):
                out += content.encode()
            elif content is not None:
                out += _dumps(content)
            out += _SEP
        return bytes(out)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        out += prompt.encode()
    elif prompt is not None:
        out += _dumps(prompt)
    return bytes(out)


def _dumps(value: object) -> bytes:
    """``value``'s canonical JSON; nothing for a value nested deeper than orjson writes (255
    levels: no template renders such a thing, and llama-server refuses it)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # orjson.JSONEncodeError: "Recursion limit reached"
        return b""


def _messages(body: Mapping[str, object]) -> object:
    """The messages of a chat, Messages or Responses request, in the order they are
    rendered; None for a completion."""
    messages = body.get("messages")
    given = body.get("input")
    if messages is None and isinstance(given, str | list):  # the Responses API
        items = [{"role": "user", "content": given}] if isinstance(given, str) else given
        messages = [
            item if not isinstance(item, dict) or "content" in item else _whole(item)
            for item in items
        ]
    system = body.get("system", body.get("instructions"))
    if system is not None and isinstance(messages, list):
        return [{"role": "system", "content": system}, *messages]
    return messages


def _whole(item: Mapping[str, object]) -> dict[str, object]:
    return {"role": item.get("type", ""), "content": item}


def prefix_chain(model: str, body: Mapping[str, object]) -> tuple[int, ...]:
    """The chained hashes of ``body``'s whole blocks (at most ``MAX_BLOCKS``), seeded with
    the model's name so equal text for two models never matches."""
    return chain_of(model, canonical(body), MAX_BLOCKS)


def chain_of(model: str, data: bytes, limit: int, *, tail: bool = False) -> tuple[int, ...]:
    """The chained hashes of the first ``limit`` whole blocks of ``data`` (``canonical``),
    and with ``tail`` one more for the bytes after the last whole block (if any, and under
    ``limit``): equal data then matches to its end, a prompt shorter than a block included.
    The first ``MAX_BLOCKS`` whole blocks are ``prefix_chain``'s, whatever ``limit``."""
    n = min(len(data) // BLOCK_BYTES, limit)
    chain: list[int] = []
    prev = hashlib.blake2b(model.encode(), digest_size=8).digest()
    for i in range(n):
        prev = hashlib.blake2b(
            prev + data[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES], digest_size=8
        ).digest()
        chain.append(int.from_bytes(prev, "big") >> 1)  # 63 bits: a plain int everywhere
    rest = data[n * BLOCK_BYTES :]
    if tail and n < limit and 0 < len(rest) < BLOCK_BYTES:
        # a part block hashes other bytes than any whole block there: it never matches one
        prev = hashlib.blake2b(prev + rest, digest_size=8).digest()
        chain.append(int.from_bytes(prev, "big") >> 1)
    return tuple(chain)


def held_blocks(chain: tuple[int, ...], held: Collection[int]) -> int:
    """How many leading blocks of ``chain`` a worker holding ``held`` has: each hash covers
    every block before it, so the first one missing ends the match."""
    n = 0
    for h in chain:
        if h not in held:
            break
        n += 1
    return n


def expected_tokens(blocks: int) -> int:
    """Matched blocks as the prompt tokens a worker is expected to reuse."""
    return int(blocks * BLOCK_BYTES / BYTES_PER_TOKEN)
