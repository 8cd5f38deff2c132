"""need.py: what context a request needs, from its body; a table, and properties of the bound
and the estimate (the bound never refuses a request whose tokens fit)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.protocol.messages import Endpoint
from shoal.router.dispatch.need import (
    MAX_TOKEN_BYTES,
    NO_NEED,
    Need,
    largest,
    need_of,
    refused,
    tokens,
)

CHAT, COMPLETIONS = Endpoint.CHAT, Endpoint.COMPLETIONS
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4000}}


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "hello"}]}, Need(4 + 5)),
        (CHAT, {"messages": [{"role": "user", "content": "hé"}]}, Need(4 + 3)),  # UTF-8 bytes
        (
            CHAT,
            {"messages": [{"role": "user", "content": "x" * 100}], "max_tokens": 7},
            Need(104, 0, 7, "max_tokens"),
        ),
        # the content's text parts count, an image's bytes do not (its tokens are not in them)
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE]}]},
            Need(6),
        ),
        (CHAT, {"messages": [{"role": "tool", "content": None}]}, Need(4)),
        (CHAT, {"messages": "nonsense"}, Need()),
        # the fewest of the fields that say (llama-server reads one of them); -1: no limit
        (
            CHAT,
            {"messages": [], "max_tokens": 9, "max_completion_tokens": 5},
            Need(0, 0, 5, "max_completion_tokens"),
        ),
        (CHAT, {"messages": [], "n_predict": -1}, Need()),
        (CHAT, {"messages": [], "n_predict": 0}, Need(0, 0, 0, "n_predict")),
        (CHAT, {"messages": [], "max_tokens": True}, Need()),  # not a number
        (COMPLETIONS, {"prompt": "abcd"}, Need(4)),
        (COMPLETIONS, {"prompt": [1, 2, 3]}, Need(0, 3)),  # token ids: exact
        (COMPLETIONS, {"prompt": [1, "ab", 2]}, Need(2, 2)),  # llama-server's mixed prompt
        (COMPLETIONS, {"prompt": ["a", "b" * 40]}, Need(40)),  # several: the longest counts
        (COMPLETIONS, {"prompt": [[1, 2], [1, 2, 3, 4]]}, Need(0, 4)),
        (Endpoint.EMBEDDINGS, {"input": "x" * 1000}, NO_NEED),
        (Endpoint.IMAGE_GENERATIONS, {"prompt": "x" * 1000}, NO_NEED),
    ],
)
def test_need_of_table(endpoint: Endpoint, body: dict[str, Any], expected: Need) -> None:
    assert need_of(endpoint, body) == expected


def test_tools_and_tool_calls_count() -> None:
    plain = need_of(CHAT, {"messages": [{"role": "user", "content": "hi"}]})
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    call = [{"id": "1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]
    body = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": call}]
    }
    assert need_of(CHAT, {**body, "tools": tools}).text_bytes > need_of(CHAT, body).text_bytes
    assert need_of(CHAT, body).text_bytes > plain.text_bytes


@pytest.mark.parametrize(
    ("need", "floor", "guess"),
    [
        (Need(), 1, 1),  # an empty prompt still needs room for one token
        (Need(4000), 33, 1001),  # 4,000 bytes: at least 32 tokens, about 1,000; and one
        (Need(4000, 0, 100, "max_tokens"), 132, 1100),
        (Need(0, 50, 0), 51, 51),  # token ids: exact either way
        (Need(MAX_TOKEN_BYTES + 1), 3, 34),
    ],
)
def test_floor_and_guess(need: Need, floor: int, guess: int) -> None:
    assert (need.floor, need.guess) == (floor, guess)


@pytest.mark.parametrize(
    ("contexts", "expected"),
    [([], None), ([2048, 4096], 4096), ([2048, None], None), ([512], 512)],
)
def test_largest(contexts: list[int | None], expected: int | None) -> None:
    assert largest(contexts) == expected


@pytest.mark.parametrize(
    ("need", "most", "is_refused", "to_hold"),
    [
        # an estimate that fits: placed by it
        (Need(8000), 4096, False, 2001),
        # estimated past the largest context but possibly fitting: tried on the largest
        (Need(20_000), 4096, False, 4096),
        # certainly too long: even at 128 bytes a token, more than the largest context
        (Need(4096 * MAX_TOKEN_BYTES), 4096, True, 4096),
        # the answer alone fills the largest context
        (Need(10, 0, 4096, "max_tokens"), 4096, True, 4096),
        (Need(10, 0, 4094, "max_tokens"), 4096, False, 4096),
        # a worker that does not say its context may hold anything
        (Need(4096 * MAX_TOKEN_BYTES), None, False, 4096 * MAX_TOKEN_BYTES // 4 + 1),
        (NO_NEED, 512, False, 0),
    ],
)
def test_refused_and_tokens(need: Need, most: int | None, is_refused: bool, to_hold: int) -> None:
    assert refused(need, most) is is_refused
    assert tokens(need, most) == to_hold


def _tokens_at_most(text: str, bytes_per_token: int) -> int:
    """Tokens of ``text`` under a vocabulary whose tokens are at most ``bytes_per_token``
    bytes long, cut as coarsely as it allows (the fewest tokens that vocabulary could give)."""
    size = len(text.encode())
    return -(-size // bytes_per_token)


@given(
    st.text(max_size=3000),
    st.integers(1, MAX_TOKEN_BYTES),
    st.integers(0, 2000),
    st.integers(64, 8192),
)
def test_the_bound_never_refuses_what_fits(
    text: str, bytes_per_token: int, output: int, context: int
) -> None:
    """Whatever the vocabulary (tokens up to ``MAX_TOKEN_BYTES``), a request whose prompt and
    answer fit a context is never refused: the refusal is certain."""
    body = {"prompt": text, "max_tokens": output} if output else {"prompt": text}
    need = need_of(COMPLETIONS, body)
    fits = _tokens_at_most(text, bytes_per_token) + max(output, 1) <= context
    if fits:
        assert not refused(need, context)
    assert need.floor <= need.guess
    if not refused(need, context):
        assert need.floor <= tokens(need, context) <= context
