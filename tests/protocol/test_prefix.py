"""The prefix chain the router and worker both compute (protocol/prefix.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shoal.protocol.prefix import BLOCK_BYTES, MAX_BLOCKS, held_blocks, prefix_chain

SYSTEM = "You are the assistant of tenant one. " * 60  # ~2 KiB: 8 whole blocks and some


def chat(*messages: tuple[str, str]) -> dict[str, object]:
    return {"messages": [{"role": r, "content": t} for r, t in messages]}


def test_a_shared_system_prompt_shares_its_blocks() -> None:
    first = prefix_chain("m", chat(("system", SYSTEM), ("user", "hello")))
    second = prefix_chain("m", chat(("system", SYSTEM), ("user", "what else? " * 40)))
    assert len(first) == (len(SYSTEM) + len("system") + 1) // BLOCK_BYTES
    shared = held_blocks(second, frozenset(first))
    assert shared == (len(SYSTEM) + len("system") + 1) // BLOCK_BYTES  # every whole block
    assert second[:shared] == first[:shared]


def test_other_text_or_model_matches_nothing() -> None:
    base = prefix_chain("m", chat(("system", SYSTEM)))
    assert held_blocks(prefix_chain("m", chat(("system", "x" + SYSTEM))), frozenset(base)) == 0
    assert held_blocks(prefix_chain("n", chat(("system", SYSTEM))), frozenset(base)) == 0
    # the role is part of the content: a user message is not a system prompt
    assert held_blocks(prefix_chain("m", chat(("user", SYSTEM))), frozenset(base)) == 0


def test_completions_and_bounds() -> None:
    assert prefix_chain("m", {"prompt": "short"}) == ()
    assert len(prefix_chain("m", {"prompt": "y" * BLOCK_BYTES * 3})) == 3
    assert len(prefix_chain("m", {"prompt": "y" * BLOCK_BYTES * (MAX_BLOCKS + 9)})) == MAX_BLOCKS
    parts = [{"type": "text", "text": SYSTEM}]
    assert len(prefix_chain("m", {"messages": [{"role": "system", "content": parts}]})) > 0


@given(st.text(max_size=3000), st.text(max_size=600), st.text(max_size=600))
def test_held_blocks_is_the_shared_prefix(common: str, a: str, b: str) -> None:
    one = prefix_chain("m", {"prompt": common + a})
    two = prefix_chain("m", {"prompt": common + b})
    n = held_blocks(two, frozenset(one))
    assert one[:n] == two[:n]
    assert n >= len(common.encode()) // BLOCK_BYTES
    assert all(h < 2**63 for h in one)
