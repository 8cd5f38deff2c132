"""Assembling a non-streamed answer from stream chunks (pure), in OpenAI's chunk format.

The real model (SmolLM2-135M) does not emit tool calls, so the tool-call merge is checked
here on chunks shaped like OpenAI's documented streaming format; tests/e2e/test_backends.py
compares whole answers against llama-server's own non-streamed ones.
"""

from __future__ import annotations

from shoal.protocol.messages import Endpoint
from shoal.worker.text.aggregate import aggregate

BASE = {"id": "c1", "created": 7, "model": "m", "object": "chat.completion.chunk"}


def chunk(
    delta: dict[str, object], finish: str | None = None, **extra: object
) -> dict[str, object]:
    return {**BASE, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def test_tool_calls_are_merged_by_index() -> None:
    chunks = [
        chunk({"role": "assistant", "content": None}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": "{}"},
                    }
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        chunk({}, finish="tool_calls"),
        {
            **BASE,
            "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14},
        },
    ]
    out = aggregate(chunks, Endpoint.CHAT)
    assert out["object"] == "chat.completion" and out["id"] == "c1"
    assert out["usage"]["total_tokens"] == 14
    [choice] = out["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    }


def test_text_and_reasoning_are_concatenated() -> None:
    chunks = [
        chunk({"role": "assistant", "content": None}),
        chunk({"reasoning_content": "think"}),
        chunk({"reasoning_content": "ing"}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo"}),
        chunk({}, finish="stop", timings={"predicted_n": 2}),
    ]
    out = aggregate(chunks, Endpoint.CHAT)
    assert out["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Hello",
        "reasoning_content": "thinking",
    }
    assert out["timings"] == {"predicted_n": 2}


def test_completions_text_and_logprobs() -> None:
    def part(text: str, lp: list[int] | None) -> dict[str, object]:
        return {
            **BASE,
            "object": "text_completion",
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": {"content": lp} if lp else None,
                    "finish_reason": None,
                }
            ],
        }

    out = aggregate([part(" a", [1]), part(" b", [2]), part("", None)], Endpoint.COMPLETIONS)
    assert out["object"] == "text_completion"
    assert out["choices"][0]["text"] == " a b"
    assert out["choices"][0]["logprobs"] == {"content": [1, 2]}
