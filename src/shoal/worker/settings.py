"""The worker's one settings object."""

from __future__ import annotations

import socket
from pathlib import Path

from pydantic import Field, SecretStr, field_validator

from shoal.models.default import DEFAULT_MODEL
from shoal.protocol.messages import WS_PATH
from shoal.settings import CommonSettings


def router_ws_url(router_url: str) -> str:
    """``host:port``, ``http(s)://host:port`` or ``ws(s)://host:port[/path]`` -> the WS URL."""
    url = router_url.strip().rstrip("/")
    for http, ws in (("http://", "ws://"), ("https://", "wss://")):
        if url.startswith(http):
            url = ws + url[len(http) :]
    if not url.startswith(("ws://", "wss://")):
        url = "ws://" + url
    scheme, rest = url.split("://", 1)
    if "/" not in rest:
        url = f"{scheme}://{rest}{WS_PATH}"
    return url


class WorkerSettings(CommonSettings):
    router_url: str = Field(
        "127.0.0.1:8000",
        description="The router to dial: host:port, or a ws:// or wss:// URL.",
    )
    gpu_key: SecretStr | None = Field(
        None, description="Key this worker presents to the router (the router's --gpu-key)."
    )
    name: str = Field(default_factory=socket.gethostname, description="Name shown for this worker.")
    model: str = Field(
        DEFAULT_MODEL.id, description="Model to serve: a known model id or a path to a .gguf file."
    )
    model_store: str | None = Field(
        None,
        description="Fetch --model from this model store (shoal data, or a router with "
        "--storage) instead of the local cache; resumable. The GPU key is sent as the key.",
    )
    model_alias: str | None = Field(
        None, description="Public model name clients use (default: the model id)."
    )
    backend_url: str | None = Field(
        None,
        description="Attach to an already running OpenAI-compatible server (llama-server, "
        "vLLM, Ollama) at this URL instead of starting llama-server.",
    )
    backend_model: str | None = Field(
        None,
        description="Model name to send to the attached backend (default: the first one it lists).",
    )
    backend_api_key: SecretStr | None = Field(
        None, description="API key for the attached backend, if it needs one."
    )
    llama_server_path: Path | None = Field(
        None, description="llama-server binary to use instead of the cached or built one."
    )
    slots: int = Field(4, ge=1, le=4096, description="Requests served at once (llama-server -np).")
    ctx_size: int = Field(
        4096, ge=256, description="Context length per slot (llama-server gets ctx-size x slots)."
    )
    threads: int | None = Field(None, ge=1, description="CPU threads for llama-server.")
    embedding: bool = Field(
        False, description="Serve embeddings (/v1/embeddings) instead of completions."
    )
    llama_server_args: str = Field(
        "", description="Extra arguments for llama-server, as one shell-quoted string."
    )
    max_restarts: int = Field(
        5, ge=0, description="Crashes within a minute after which llama-server is not restarted."
    )

    @field_validator("name")
    @classmethod
    def _name_ok(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("name must not be empty")
        return value.strip()

    @property
    def ws_url(self) -> str:
        return router_ws_url(self.router_url)
