"""The model store's one settings object."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator

from shoal.paths import default_data_dir
from shoal.security import is_loopback, missing_keys
from shoal.settings import (
    CommonSettings,
    SecretList,
    flag_and_variable,
    server_variable,
    split_commas,
)

GIB = 1024**3
DEFAULT_MAX_UPLOAD_BYTES = 256 * GIB


def default_storage_dir() -> Path:
    """Where the store keeps its GGUF files unless told otherwise."""
    return default_data_dir() / "store"


class DataSettings(CommonSettings):
    storage: Path = Field(
        default_factory=default_storage_dir,
        description="Folder of .gguf files the store serves (a model's id is its file name "
        "without .gguf, lowercased).",
    )
    host: str = Field("127.0.0.1", description="Address to listen on (loopback by default).")
    port: int = Field(8100, ge=0, le=65535, description="Port to listen on.")
    admin_key: SecretList = Field(
        (),
        description="Comma-separated keys that may upload models (Authorization: Bearer). "
        "Without one, uploads are disabled. Required when listening beyond loopback.",
    )
    api_key: Annotated[SecretList, server_variable("data", "api_key")] = Field(
        (),
        description="Comma-separated keys workers must present to list and download models. "
        "Without one, reads are open. Required when listening beyond loopback.",
    )
    max_upload_bytes: int = Field(
        DEFAULT_MAX_UPLOAD_BYTES, gt=0, description="Largest model file an upload may send."
    )

    _split_keys = field_validator("admin_key", "api_key", mode="before")(split_commas)

    @property
    def on_loopback(self) -> bool:
        return is_loopback(self.host)

    def security_problem(self) -> str | None:
        """Why this configuration must not start, or None. Loopback may run open."""
        missing = missing_keys(
            self.host,
            {
                flag_and_variable(DataSettings, "api_key"): self.api_key,
                flag_and_variable(DataSettings, "admin_key"): self.admin_key,
            },
        )
        if not missing:
            return None
        return (
            f"refusing to listen on {self.host} without {' and '.join(missing)}: anyone on the "
            "network could download or replace this store's models. Set the key(s), or listen "
            "on 127.0.0.1."
        )
