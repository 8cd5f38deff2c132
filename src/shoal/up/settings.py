"""``shoal up``'s one settings object: the few knobs of a one-machine cluster."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from shoal.llama_cpp.options import LlamaCppOptions
from shoal.models.default import DEFAULT_MODEL
from shoal.router.settings import ROUTER_API_KEY_VARIABLE


class UpSettings(LlamaCppOptions):
    host: str = Field("127.0.0.1", description="Address the router listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port the router listens on.")
    model: str = Field(
        DEFAULT_MODEL.id,
        description="Model to serve: a catalog id (`shoal models list`) or a .gguf file.",
    )
    model_alias: str | None = Field(None, description="Public model name clients use.")
    image_model: str | None = Field(
        None,
        description="Also serve this image model (/v1/images/*): a diffusers pipeline folder, "
        "a .safetensors checkpoint or a Hugging Face repo id. Needs pip install 'shoal[image]'.",
    )
    slots: int = Field(4, ge=1, le=4096, description="Requests served at once.")
    ctx_size: int = Field(4096, ge=256, description="Context length per slot.")
    threads: int | None = Field(None, ge=1, description="CPU threads for llama-server.")
    api_key: Annotated[str | None, ROUTER_API_KEY_VARIABLE] = Field(
        None,
        description="An extra API key clients may send (besides the key database's keys; the "
        "first run creates an inference and an admin key there and prints them once).",
    )
    database_url: str | None = Field(
        None,
        description="Key database (SQLAlchemy URL). Default: a SQLite file in Shoal's data folder.",
    )
