"""``shoal up``'s one settings object: the few knobs of a one-machine cluster."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from shoal.models.default import DEFAULT_MODEL
from shoal.settings import CommonSettings


class UpSettings(CommonSettings):
    host: str = Field("127.0.0.1", description="Address the router listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port the router listens on.")
    model: str = Field(
        DEFAULT_MODEL.id, description="Model to serve: a known model id or a path to a .gguf file."
    )
    model_alias: str | None = Field(None, description="Public model name clients use.")
    slots: int = Field(4, ge=1, le=4096, description="Requests served at once.")
    ctx_size: int = Field(4096, ge=256, description="Context length per slot.")
    threads: int | None = Field(None, ge=1, description="CPU threads for llama-server.")
    llama_server_path: Path | None = Field(
        None, description="llama-server binary to use instead of the cached or built one."
    )
    api_key: str | None = Field(
        None,
        description="API key clients must send. Generated and printed when listening beyond "
        "loopback without one.",
    )
