"""prefix.canonical for the Responses and Messages APIs: a conversation that grows keeps its
prefix, and the system prompt comes first, as a template renders it."""

from __future__ import annotations

from shoal.protocol.prefix import canonical, prefix_chain

LONG = "Describe the shelves of the warehouse in detail. " * 20


def test_a_growing_responses_conversation_keeps_its_prefix() -> None:
    first = {"instructions": LONG, "input": [{"role": "user", "content": LONG}]}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    later = {**first, "input": [*first["input"], call, output]}
    assert canonical(later).startswith(canonical(first))
    assert b"function_call_output" in canonical(later)
    chain = prefix_chain("m", first)
    assert len(chain) >= 7 and prefix_chain("m", later)[: len(chain)] == chain


def test_a_string_input_is_a_user_message() -> None:
    assert canonical({"input": "hi"}) == canonical({"input": [{"role": "user", "content": "hi"}]})


def test_the_system_prompt_comes_first() -> None:
    anthropic = {"system": "S", "messages": [{"role": "user", "content": "hi"}]}
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]}
    assert canonical(anthropic) == canonical(chat)
    responses = {"instructions": "S", "input": "hi"}
    assert canonical(responses) == canonical(chat)


def test_content_nested_too_deep_to_write_counts_as_nothing() -> None:
    """orjson writes at most 255 levels; the router must not fail on a body it parsed."""
    deep: object = "x"
    for _ in range(300):
        deep = [deep]
    for body in (
        {"messages": [{"role": "user", "content": deep}]},
        {"input": [{"role": "user", "content": deep}]},
        {"prompt": deep},
    ):
        assert canonical(body) in (b"user\x1f\x1e", b"")
