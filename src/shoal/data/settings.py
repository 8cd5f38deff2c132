"""The model store's one settings object."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator

from shoal.paths import default_data_dir
from shoal.security import is_loopback
from shoal.settings import (
    SecretList,
    TlsServerSettings,
    server_variable,
    split_commas,
)

GIB = 1024**3
DEFAULT_MAX_UPLOAD_BYTES = 256 * GIB


def default_storage_dir() -> Path:
    """Where the store keeps its GGUF files unless told otherwise."""
    return default_data_dir() / "store"


class DataSettings(TlsServerSettings):
    storage: Path = Field(
        default_factory=default_storage_dir,
        description="Folder of .gguf files the store serves (a model's id is its file name "
        "without .gguf, lowercased).",
    )
    host: str = Field("127.0.0.1", description="Address to listen on (loopback by default).")
    port: int = Field(8100, ge=0, le=65535, description="Port to listen on.")
    admin_key: SecretList = Field(
        (),
        description="Comma-separated keys that may upload models (Authorization: Bearer), "
        "besides the key database's admin keys. Without any, uploads are disabled. Required "
        "(here or in the key database) when listening beyond loopback.",
    )
    api_key: Annotated[SecretList, server_variable("data", "api_key")] = Field(
        (),
        description="Comma-separated keys workers must present to list and download models, "
        "besides the key database's (worker, inference and admin keys). Without any, reads "
        "are open. Required (here or in the key database) when listening beyond loopback.",
    )
    database_url: str | None = Field(
        None,
        description="Also accept the keys of this key database (the router's --database-url: "
        "postgresql://..., sqlite:///path): its worker and inference keys read, its admin keys "
        "upload. Default: none, only --api-key and --admin-key.",
    )
    max_upload_bytes: int = Field(
        DEFAULT_MAX_UPLOAD_BYTES, gt=0, description="Largest model file an upload may send."
    )

    _split_keys = field_validator("admin_key", "api_key", mode="before")(split_commas)

    @property
    def on_loopback(self) -> bool:
        return is_loopback(self.host)
