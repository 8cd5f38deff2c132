"""Rebuild a non-streamed OpenAI response from the chunks of a streamed one (pure).

Why: llama-server notices a closed connection on a *non-streaming* request only when its
result queue stays silent for a whole second, which never happens while other slots are
generating (``server_response::recv_with_timeout`` restarts its wait on every result).
A streaming request checks on every token. So the worker asks its own llama-server for a
stream and gives the client the non-streamed body it asked for: cancelling then stops
the generation at the next token.
"""

from __future__ import annotations

from typing import Any

from shoal.protocol.messages import Endpoint

_TOP_LEVEL = ("id", "created", "model", "system_fingerprint")


def aggregate(chunks: list[dict[str, Any]], endpoint: Endpoint) -> dict[str, Any]:
    chat = endpoint is Endpoint.CHAT
    out: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for key in _TOP_LEVEL:
            if key in chunk and key not in out:
                out[key] = chunk[key]
        for part in chunk.get("choices") or ():
            index = int(part.get("index", 0))
            acc = choices.get(index)
            if acc is None:
                acc = choices[index] = _new_choice(index, chat)
            _merge_choice(acc, part, chat)
        for key in ("usage", "timings"):
            if chunk.get(key):
                out[key] = chunk[key]
    out["object"] = "chat.completion" if chat else "text_completion"
    out["choices"] = [choices[i] for i in sorted(choices)]
    return out


def _new_choice(index: int, chat: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "finish_reason": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": None}
    else:
        choice["text"] = ""
    return choice


def _merge_choice(acc: dict[str, Any], part: dict[str, Any], chat: bool) -> None:
    if chat:
        _merge_delta(acc["message"], part.get("delta") or {})
    else:
        acc["text"] += part.get("text") or ""
    logprobs = part.get("logprobs")
    if logprobs:
        merged = acc.setdefault("logprobs", {})
        for key, value in logprobs.items():
            if isinstance(value, list):
                merged.setdefault(key, []).extend(value)
            else:
                merged[key] = value
    if part.get("finish_reason"):
        acc["finish_reason"] = part["finish_reason"]


def _merge_delta(message: dict[str, Any], delta: dict[str, Any]) -> None:
    for key, value in delta.items():
        if key == "role" and value:
            message["role"] = value
        elif key == "tool_calls" and value:
            calls = message.setdefault("tool_calls", [])
            for call in value:
                _merge_tool_call(calls, call)
        elif isinstance(value, str):
            message[key] = (message.get(key) or "") + value
        elif value is not None and key not in message:
            message[key] = value


def _merge_tool_call(calls: list[dict[str, Any]], part: dict[str, Any]) -> None:
    index = int(part.get("index", len(calls)))
    while len(calls) <= index:
        calls.append({"type": "function", "function": {"name": "", "arguments": ""}})
    call = calls[index]
    if part.get("id"):
        call["id"] = part["id"]
    if part.get("type"):
        call["type"] = part["type"]
    function = part.get("function") or {}
    call["function"]["name"] += function.get("name") or ""
    call["function"]["arguments"] += function.get("arguments") or ""
