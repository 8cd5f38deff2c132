"""The router's one settings object."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from shoal.models.default import DEFAULT_MODEL
from shoal.security import is_loopback, missing_keys
from shoal.settings import CommonSettings, SecretList, split_commas


class RouterSettings(CommonSettings):
    host: str = Field("127.0.0.1", description="Address to listen on (loopback by default).")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    api_key: SecretList = Field(
        (),
        description="Comma-separated API keys clients must present (Authorization: Bearer). "
        "Required when listening beyond loopback.",
    )
    gpu_key: SecretList = Field(
        (),
        description="Comma-separated keys workers must present to join. "
        "Required when listening beyond loopback.",
    )
    admin_key: SecretList = Field(
        (), description="Comma-separated keys allowed to upload to the embedded model store."
    )
    storage: Path | None = Field(
        None,
        description="Also serve the GGUF files in this folder as a model store "
        "(/api/v1/models/...), for workers and the pipeline planner.",
    )
    default_model: str = Field(
        DEFAULT_MODEL.id,
        description="Model used when a request names none.",
    )
    max_queue: int = Field(
        256, ge=0, description="Requests that may wait per model before new ones get 429."
    )
    max_wait: float = Field(
        60.0, gt=0, description="Seconds a request may wait for a free worker before a 503."
    )
    max_requeues: int = Field(
        2, ge=0, description="Times a job is handed to another worker when its worker is lost."
    )
    heartbeat_interval: float = Field(5.0, gt=0, description="Seconds between worker heartbeats.")
    heartbeat_misses: int = Field(
        3, ge=1, description="Missed heartbeats after which a worker is dropped."
    )

    _split_api = field_validator("api_key", "gpu_key", "admin_key", mode="before")(split_commas)

    @property
    def heartbeat_timeout(self) -> float:
        return self.heartbeat_interval * self.heartbeat_misses

    @property
    def on_loopback(self) -> bool:
        return is_loopback(self.host)

    def security_problem(self) -> str | None:
        """Why this configuration must not start, or None. Loopback may run open."""
        missing = missing_keys(
            self.host,
            {"--api-key/SHOAL_API_KEY": self.api_key, "--gpu-key/SHOAL_GPU_KEY": self.gpu_key},
        )
        if not missing:
            return None
        return (
            f"refusing to listen on {self.host} without {' and '.join(missing)}: anyone on the "
            "network could use or join this cluster. Set the key(s), or listen on 127.0.0.1."
        )
